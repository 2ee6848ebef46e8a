"""ilcp.formatting: the one way every table writes a percentage and a byte count."""

from ilcp.formatting import byte_count, percent


def test_percent_writes_one_decimal_and_its_interval():
    assert percent(None) == "-"
    assert percent(0.5) == "50.0"
    assert percent(0.4125, (0.3, 0.52)) == "41.2 [30.0, 52.0]"
    assert percent(0.4125, (0.3, 0.52), unit="%") == "41.2% [30.0, 52.0]"  # the console summary's form
    assert percent(1.0, None, unit="%") == "100.0%"


def test_byte_count_keeps_a_fraction_unless_told_whole():
    assert byte_count(None) == "-"
    assert byte_count(163) == "163"
    assert byte_count(23570.0) == "23,570"
    assert byte_count(1459.5) == "1,459.5"
    assert byte_count(1459.5, whole=True) == "1,460"
