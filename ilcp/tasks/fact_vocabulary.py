"""The words of the ``facts`` task (`ilcp.tasks.facts`): its attributes and their statement and
question templates, the entities facts are about, the filler sentences, and the value
vocabularies of the value-split modes with their fixed train / held-out partition.

``FACT_VOCABULARIES`` (people, cities, years, colours) are each partitioned once and for all by a
fixed hash into train values and held-out values (``HELDOUT_FRACTION`` of each vocabulary);
`fact_values` gives either share.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from typing import NamedTuple


class FactAttribute(NamedTuple):
    statement: str  # "{entity} ... {value}."
    question: str   # "... {entity} ...?"
    values: tuple[str, ...]


_PEOPLE = tuple("Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Liam Maria Nina "
                "Oscar Paula Quentin Rachel Samuel Tara Victor Wendy Xavier Yusuf Zoe Hugo Ingrid "
                "Leon Mei Omar Priya Sofia Tomas Anika Boris Chloe Diego Elena Felix "
                "Hannah".split())
_CITIES = tuple("Lisbon Oslo Madrid Vienna Prague Dublin Warsaw Berlin Paris Rome Athens Helsinki "
                "Stockholm Copenhagen Budapest Zurich Geneva Munich Hamburg Milan Naples Porto "
                "Seville Valencia Krakow Tallinn Riga Vilnius Bergen Lyon Marseille Antwerp "
                "Rotterdam Bristol Leeds Glasgow Cardiff Toronto Boston Chicago Denver Seattle "
                "Austin Sydney Melbourne Osaka Kyoto Seoul Mumbai Nairobi Cairo Lima".split())
_COLOURS = tuple("red blue green yellow orange purple white black grey brown pink silver".split())
_YEARS = tuple(str(year) for year in range(1950, 2025))
WEATHER = tuple("mild cold windy rainy sunny warm foggy dry".split())

FACT_ATTRIBUTES = {
    "owner": FactAttribute("{entity} is owned by {value}.", "Who owns {entity}?", _PEOPLE),
    "manager": FactAttribute("{entity} is managed by {value}.", "Who manages {entity}?", _PEOPLE),
    "city": FactAttribute("{entity} is based in {value}.", "In which city is {entity} based?",
                          _CITIES),
    "year": FactAttribute("{entity} was launched in {value}.",
                          "In which year was {entity} launched?", _YEARS),
    "colour": FactAttribute("{entity} is painted {value}.", "What colour is {entity}?", _COLOURS),
}

# Trees, minerals and birds; none is also a person's name, a city or a colour.
BASE_ENTITIES = tuple(
    "Cedar Birch Maple Oak Aspen Alder Spruce Larch Poplar Elm Cypress Juniper Linden Sequoia "
    "Hemlock Sycamore Beech Acacia Magnolia Quartz Basalt Granite Cobalt Garnet Topaz Onyx Agate "
    "Feldspar Mica Obsidian Pyrite Galena Gypsum Marble Flint Zircon Malachite Cinnabar Dolomite "
    "Falcon Heron Osprey Kestrel Finch Sparrow Condor Plover Egret Pelican Puffin Starling Swift "
    "Oriole Curlew Albatross Gannet Lark Ibis Kingfisher Petrel Tern Raven Harrier".split())
# One-word composites ("Cedarbrook") for contexts that need more entities than BASE_ENTITIES.
ALL_ENTITIES = BASE_ENTITIES + tuple(
    base + suffix for suffix in "brook field haven ridge wood stone vale moor crest ford".split()
    for base in BASE_ENTITIES)

FILLERS = (
    "The weather in {city} was {weather} that week.",
    "{person} spent a weekend in {city}.",
    "{person} visited {city} in {year}.",
    "A trade fair took place in {city} in {year}.",
    "{person} and {other} met for coffee in {city}.",
    "{person} bought {colour} curtains.",
    "The morning train to {city} was late.",
    "{person} wrote a short report in {year}.",
    "Many visitors came to {city} in {year}.",
    "{person} prefers {colour} notebooks.",
)
# Value vocabularies of the value-split modes: each starts with the original values and adds
# more real names and words of the same kind, all single words, none shared between two
# vocabularies or with an entity, a weather word or a word of the sentence templates.
FACT_VOCABULARIES = {
    "person": _PEOPLE + tuple(
        "Aaron Abigail Adam Adrian Ahmed Aisha Alan Albert Alberto Alexei Alfred Amara Amir Ana "
        "Andre Andrea Angela Anna Anton Arjun Arthur Astrid Beatrice Benjamin Bernard Bianca "
        "Bruno Caleb Camila Carlos Caroline Cecilia Charles Clara Colin Conor Cristina Daniel "
        "Daria Derek Dmitri Dora Edgar Edith Eduardo Elias Elif Eliza Emil Emily Enzo Eric Erik "
        "Esther Ethan Eva Fatima Fernando Fiona Florian Francesca Gabriel Gemma Georg George "
        "Gerald Gustav Hamid Harold Harriet Hassan Helen Hector Helga Hiroshi Ian Ibrahim Igor "
        "Ines Isaac Isabel Ivan Jacob James Jamal Jane Javier Jonas Jorge Joseph Julia Julian Kai "
        "Kamala Karl Kasper Katja Kenji Kevin Khalid Klaus Lars Laura Leila Lena Leonard Lucas "
        "Lucia Luis Luka Magnus Malik Marco Marek Margaret Marius Martha Mateo Matilda Max Miguel "
        "Mila Miriam Mohammed Monica Nadia Naomi Nathan Nikolai Noah Nora Olga Oliver Olivia "
        "Pablo Patrick Pedro Peter Philip Pieter Rafael Rahul Ravi Rebecca Ricardo Rita Robert "
        "Roberto Rosa Rui Ruth Sakura Salma Sara Sebastian Simon Stefan Susan Sven Tanya "
        "Theo Thomas Timothy Ulrich Ursula Valeria Vera Viktor Walter Wei William Yara Yuki Yves "
        "Zara Zainab Agnes Alma Anders Beatriz Dalia Elsa Emre Farid Gita Hana Ilse Jana Joel "
        "Kofi Lotte Maya Nils Oskar Petra Rania Soren Tobias Uma Vanya Wanda Yasmin Zeynep Amelia "
        "Benedict Cyrus Desmond Dorothy Edmund Elijah Eleanor Gideon Greta Hilda Imogen Ivo "
        "Jasper Joaquin Kiran Leopold Lionel Lorenzo Lydia Mabel Mario Matteo Mira Nadine Nikhil "
        "Odette Orla Otto Quinn Raquel Reza Rohan Rupert Silas Tamsin Tessa Ugo Vivian Wilhelm "
        "Yosef Zoltan".split()),
    "city": _CITIES + tuple(
        "Amsterdam Barcelona Bilbao Bologna Bordeaux Bratislava Brussels Bucharest Cologne "
        "Dresden Edinburgh Florence Frankfurt Gdansk Genoa Ghent Gothenburg Graz Hanover "
        "Innsbruck Istanbul Kyiv Leipzig Liverpool Ljubljana Lucerne Luxembourg Malmo Manchester "
        "Minsk Montpellier Nantes Nuremberg Palermo Pisa Reykjavik Salzburg Sarajevo Stuttgart "
        "Strasbourg Tampere Thessaloniki Toulouse Trieste Turin Utrecht Venice Verona Wroclaw "
        "Zagreb Belgrade Skopje Tirana Valletta Nicosia Ankara Izmir Tbilisi Yerevan Baku Tehran "
        "Baghdad Beirut Amman Damascus Jerusalem Riyadh Dubai Doha Muscat Karachi Lahore Delhi "
        "Kolkata Chennai Bangalore Hyderabad Colombo Kathmandu Dhaka Yangon Bangkok Hanoi Manila "
        "Jakarta Singapore Taipei Shanghai Beijing Shenzhen Tokyo Nagoya Sapporo Busan Perth "
        "Brisbane Adelaide Auckland Wellington Vancouver Montreal Ottawa Calgary Winnipeg Halifax "
        "Quebec Detroit Atlanta Miami Dallas Houston Phoenix Portland Philadelphia Baltimore "
        "Pittsburgh Cleveland Memphis Nashville Minneapolis Milwaukee Sacramento Oakland Honolulu "
        "Anchorage Havana Bogota Quito Caracas Santiago Montevideo Asuncion Recife Brasilia "
        "Curitiba Medellin Cusco Guadalajara Monterrey Tijuana Lagos Accra Dakar Casablanca "
        "Marrakesh Tunis Algiers Kampala Kigali Lusaka Harare Durban Johannesburg Khartoum "
        "Mombasa Luanda Maputo Windhoek Kinshasa".split()),
    "year": _YEARS + tuple(str(year) for year in range(1800, 1950)),
    "colour": _COLOURS + tuple(
        "crimson scarlet maroon navy teal turquoise cyan magenta violet indigo lavender lilac "
        "beige ivory cream tan khaki olive amber gold bronze copper ochre mauve burgundy coral "
        "salmon peach mint lime charcoal plum azure vermilion sienna taupe saffron mustard "
        "emerald jade ruby sapphire slate aqua fuchsia periwinkle rust".split()),
}
# The vocabulary each attribute's values come from.
FACT_ATTRIBUTE_VOCABULARY = {"owner": "person", "manager": "person", "city": "city",
                             "year": "year", "colour": "colour"}
VALUE_SPLITS = ("train", "heldout")
# Share of each vocabulary held out: the values with the smallest CRC-32 of
# "ilcp-heldout-value/<value>" (ties by the value), rounded to a whole count.
HELDOUT_FRACTION = 0.25


def _partition_values(values: Sequence[str]) -> dict[str, tuple[str, ...]]:
    ranked = sorted(values, key=lambda v: (zlib.crc32(f"ilcp-heldout-value/{v}".encode()), v))
    held = set(ranked[:round(len(values) * HELDOUT_FRACTION)])
    return {"train": tuple(v for v in values if v not in held),
            "heldout": tuple(v for v in values if v in held)}


VALUE_PARTITION = {name: _partition_values(values) for name, values in FACT_VOCABULARIES.items()}


def fact_values(vocabulary: str, value_split: str | None = None) -> tuple[str, ...]:
    """The values of a vocabulary ("person", "city", "year", "colour") or of an attribute of
    ``FACT_ATTRIBUTES`` ("owner", ...) in the value-split modes: all of them (``None``), or the
    train or held-out share (``"train"``, ``"heldout"``), in vocabulary order."""
    name = FACT_ATTRIBUTE_VOCABULARY.get(vocabulary, vocabulary)
    if name not in FACT_VOCABULARIES:
        raise ValueError(f"unknown vocabulary {vocabulary!r}; available: "
                         f"{', '.join([*FACT_VOCABULARIES, *FACT_ATTRIBUTE_VOCABULARY])}")
    if value_split is None:
        return FACT_VOCABULARIES[name]
    check_value_split(value_split)
    return VALUE_PARTITION[name][value_split]


def check_value_split(value_split) -> None:
    """ValueError unless ``value_split`` is one of ``VALUE_SPLITS``."""
    if value_split not in VALUE_SPLITS:
        raise ValueError(f"unknown value_split {value_split!r}; available: "
                         f"{', '.join(VALUE_SPLITS)} (or None for the original facts task)")


def filler_sentence(rng: random.Random, people: Sequence[str] = _PEOPLE,
                    cities: Sequence[str] = _CITIES, years: Sequence[str] = _YEARS,
                    colours: Sequence[str] = _COLOURS) -> str:
    """One of ``FILLERS`` with values drawn from the given vocabularies (the original ones by
    default) and a ``WEATHER`` word."""
    person, other = rng.sample(people, 2)
    return rng.choice(FILLERS).format(person=person, other=other, city=rng.choice(cities),
                                      year=rng.choice(years), colour=rng.choice(colours),
                                      weather=rng.choice(WEATHER))
