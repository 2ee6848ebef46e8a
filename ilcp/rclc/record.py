"""Selection records: which positions a selector kept, with decoded spans and an HTML view.

Recording is opt-in (``transfer(..., record_selection=True)``). It is CPU bookkeeping kept
outside the payload (it never counts in ``Message.nbytes``). Indices are authoritative; decoded
text can differ in formatting or split multi-byte characters.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

import torch

KEPT_STYLE = "background:#b9f6b0"
OMITTED_STYLE = "color:#8a8a8a"
CONTINUOUS_KEPT_STYLE = "background:#b9f6b0;font-style:italic"
CONTINUOUS_OMITTED_STYLE = "color:#8a8a8a;font-style:italic"


@dataclass
class SelectionRecord:
    """One sender's selection for one request.

    Attributes:
        indices: kept positions, zero-based in the state the selector saw.
        source_positions: number of positions in that state.
        budget: the fitted message budget (reserved reasoning rows included).
        spans: consecutive runs ``{"start", "stop" (exclusive), "kept", "kind", "text"}`` covering
            the state; kind is "text", "latent", "continuous" (other -1 rows) or "unknown" (no IDs);
            text is decoded for "text" runs and None otherwise.
        added_latent_positions: positions in the message of rows appended after selection
            (they have no source index).
    """

    indices: list[int]
    source_positions: int
    budget: int
    spans: list[dict] = field(default_factory=list)
    added_latent_positions: list[int] = field(default_factory=list)

    def inspect(self) -> dict:
        """A JSON-serialisable copy."""
        return {
            "indices": list(self.indices),
            "source_positions": self.source_positions,
            "budget": self.budget,
            "spans": [dict(s) for s in self.spans],
            "added_latent_positions": list(self.added_latent_positions),
        }

    def html(self, title: str = "") -> str:
        """The state's text with kept spans highlighted in green and omitted text greyed."""
        parts = []
        for span in self.spans:
            length = span["stop"] - span["start"]
            if span["kind"] == "text" and span["text"] is not None:
                body = html.escape(span["text"])
                style = KEPT_STYLE if span["kept"] else OMITTED_STYLE
            else:
                body = html.escape(f"[{span['kind']} x{length}]")
                style = CONTINUOUS_KEPT_STYLE if span["kept"] else CONTINUOUS_OMITTED_STYLE
            state = "kept" if span["kept"] else "omitted"
            parts.append(f'<span class="rclc-{state}" style="{style}" title="{span["start"]}:{span["stop"]}">{body}</span>')
        if self.added_latent_positions:
            n = len(self.added_latent_positions)
            parts.append(f'<span class="rclc-added" style="{CONTINUOUS_KEPT_STYLE}">[+{n} latent rows added after selection]</span>')
        header = html.escape(
            f"{title}kept {len(self.indices)} of {self.source_positions} positions (budget {self.budget})"
        )
        return (
            f'<div class="rclc-selection"><div style="font-weight:bold">{header}</div>'
            f'<pre style="white-space:pre-wrap">{"".join(parts)}</pre></div>'
        )


def record_selection(state, indices: torch.Tensor, budget: int, added_latent: int, message_positions: int) -> SelectionRecord:
    """Build the record for ``indices`` (int64 [k]) kept from ``state`` (a SenderState)."""
    total = state.positions
    kept = torch.zeros(total, dtype=torch.bool)
    kept[indices] = True
    latent_start = total - state.latent_steps
    ids = None if state.token_ids is None else state.token_ids.detach().cpu()

    def kind(p: int) -> str:
        if p >= latent_start:
            return "latent"
        if ids is None:
            return "unknown"
        return "text" if int(ids[p]) >= 0 else "continuous"

    spans: list[dict] = []
    start = 0
    for p in range(1, total + 1):
        if p == total or bool(kept[p]) != bool(kept[start]) or kind(p) != kind(start):
            k = kind(start)
            text = None
            if k == "text" and state.tokenizer is not None:
                text = state.tokenizer.decode(ids[start:p].tolist(), skip_special_tokens=False)
            spans.append({"start": start, "stop": p, "kept": bool(kept[start]), "kind": k, "text": text})
            start = p
    return SelectionRecord(
        indices=[int(i) for i in indices.tolist()],
        source_positions=total,
        budget=int(budget),
        spans=spans,
        added_latent_positions=list(range(message_positions - added_latent, message_positions)),
    )
