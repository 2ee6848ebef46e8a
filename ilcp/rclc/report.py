"""`Agent.inspect()`: a JSON-serialisable report of a bound agent, with no forward pass.

    {
      "backend": "hf", "context_limit": 4096, "max_new_tokens": 128, "placement": "prefix",
      "queued": 1, "tensor_bytes": 8192,
      "deliveries": [{
          "index": 0, "request": "Who owns Cedar?", "positions": 32, "tensor_bytes": 8192,
          "prompt_positions": 20, "output_positions": 128,
          "remaining_positions": 3916,      # context - prompt - output - received; < 0: will not fit
          "senders": [{"positions": 32, "tensor_bytes": 8192, "representation": "embeddings",
                       "continuous_positions": 32, "token_id_positions": 0}],
          "selection": [...]                # only with selection=True; None where not recorded
      }],
      "pending": null | {"source": "pop", "positions": 52, "inherited_positions": 32},
      "sender": {"source": "history", "positions": 40, "inherited_positions": 0,
                 "latent_steps": 0, "cached_positions": 40, "remaining_positions": 3928}
    }

``tensor_bytes`` is `Message.nbytes` (summed over messages and deliveries): the bytes of the
payload tensors only, without Python objects, metadata (selection records included) or
transport framing; the spec's "payload bytes". ``cached_positions`` describes the prepared state
(the explicit state, or the history as last prefilled), not chat history changed since;
``sender.remaining_positions`` is the room left for local generation after it and the output
reservation.

The report reads the agent through its public views only (`Agent.queued`, `Agent.pending`,
`Agent.state_source`, `Agent.prepared_state` and its settings).
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
        "tensor_bytes": m.nbytes,
        "representation": m.representation,
        "continuous_positions": continuous,
        "token_id_positions": m.positions - continuous,
    }


def agent_report(agent, *, selection: bool = False) -> dict:
    """The report described in the module docstring for ``agent`` (an `Agent`)."""
    allowance = agent.max_new_tokens
    context_limit = agent.context_limit
    deliveries = []
    for index, (delivery, prompt) in enumerate(agent.queued()):
        entry = {
            "index": index,
            "request": _request(delivery.request),
            "positions": delivery.positions,
            "tensor_bytes": delivery.nbytes,
            "prompt_positions": prompt.positions,
            "output_positions": allowance,
            "remaining_positions": context_limit - prompt.positions - allowance - delivery.positions,
            "senders": [_message(m) for m in delivery.messages],
        }
        if selection:
            entry["selection"] = delivery.inspect_selection()
        deliveries.append(entry)

    pending = agent.pending
    pending_report = None
    if pending is not None:
        pending_report = {
            "source": pending.source,
            "positions": pending.positions,
            "inherited_positions": pending.inherited_positions,
        }

    state = agent.prepared_state
    cached = 0 if state is None else state.positions
    sender = {
        "source": agent.state_source,
        "positions": None if state is None else state.positions,
        "inherited_positions": None if state is None else state.inherited_positions,
        "latent_steps": None if state is None else state.latent_steps,
        "cached_positions": cached,
        "remaining_positions": None if state is None else context_limit - cached - allowance,
    }
    return {
        "backend": agent.backend,
        "context_limit": context_limit,
        "max_new_tokens": allowance,
        "placement": agent.placement,
        "queued": len(deliveries),
        "tensor_bytes": sum(d["tensor_bytes"] for d in deliveries),
        "deliveries": deliveries,
        "pending": pending_report,
        "sender": sender,
    }
