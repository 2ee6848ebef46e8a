"""`Agent.inspect()`: a JSON-serialisable report of a bound agent, with no forward pass.

    {
      "backend": "hf", "context_limit": 4096, "max_new_tokens": 128, "placement": "prefix",
      "queued": 1, "payload_bytes": 8192,
      "deliveries": [{
          "index": 0, "request": "Who owns Cedar?", "positions": 32, "payload_bytes": 8192,
          "prompt_positions": 20, "output_positions": 128,
          "remaining_positions": 3916,      # context - prompt - output - received; < 0: will not fit
          "senders": [{"positions": 32, "payload_bytes": 8192, "representation": "embeddings",
                       "continuous_positions": 32, "token_id_positions": 0}],
          "selection": [...]                # only with selection=True; None where not recorded
      }],
      "pending": null | {"source": "pop", "positions": 52, "inherited_positions": 32},
      "sender": {"source": "history", "positions": 40, "inherited_positions": 0,
                 "latent_steps": 0, "cached_positions": 40, "remaining_positions": 3928}
    }

``cached_positions`` describes the prepared state (the explicit state, or the history as last
prefilled), not chat history changed since; ``sender.remaining_positions`` is the room left for
local generation after it and the output reservation.
"""

from __future__ import annotations


def _request(request) -> object:
    if isinstance(request, str):
        return request
    return {"token_ids": [int(t) for t in request.reshape(-1).tolist()]}


def _message(m) -> dict:
    continuous = m.positions if m.token_ids is None else int((m.token_ids == -1).sum())
    return {
        "positions": m.positions,
        "payload_bytes": m.nbytes,
        "representation": m.representation,
        "continuous_positions": continuous,
        "token_id_positions": m.positions - continuous,
    }


def agent_report(agent, *, selection: bool = False) -> dict:
    """The report described in the module docstring for ``agent`` (an `Agent`)."""
    receiver = agent._receiver
    allowance = receiver.output_allowance
    deliveries = []
    for index, (delivery, prompt) in enumerate(receiver.queued()):
        entry = {
            "index": index,
            "request": _request(delivery.request),
            "positions": delivery.positions,
            "payload_bytes": delivery.nbytes,
            "prompt_positions": prompt.positions,
            "output_positions": allowance,
            "remaining_positions": receiver.context_limit - prompt.positions - allowance - delivery.positions,
            "senders": [_message(m) for m in delivery.messages],
        }
        if selection:
            entry["selection"] = delivery.inspect_selection()
        deliveries.append(entry)

    pending = agent._pending
    pending_report = None
    if pending is not None:
        pending_report = {
            "source": pending.source,
            "positions": int(pending.embeds.shape[1]),
            "inherited_positions": pending.inherited,
        }

    if agent._explicit is not None:
        state, source = agent._explicit, "explicit"
    elif agent._history is not None:
        state, source = agent._history[1], "history"
    else:
        state, source = None, "history" if agent.messages else "none"
    cached = 0 if state is None else state.positions
    sender = {
        "source": source,
        "positions": None if state is None else state.positions,
        "inherited_positions": None if state is None else state.inherited_positions,
        "latent_steps": None if state is None else state.latent_steps,
        "cached_positions": cached,
        "remaining_positions": None if state is None else receiver.context_limit - cached - allowance,
    }
    return {
        "backend": agent.backend,
        "context_limit": receiver.context_limit,
        "max_new_tokens": allowance,
        "placement": receiver.placement,
        "queued": len(deliveries),
        "payload_bytes": sum(d["payload_bytes"] for d in deliveries),
        "deliveries": deliveries,
        "pending": pending_report,
        "sender": sender,
    }
