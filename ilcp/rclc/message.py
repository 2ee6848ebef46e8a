"""`Message` (one sender's selected rows) and `Delivery` (what every receiver of a request gets)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field

import torch

from ilcp.rclc.record import SelectionRecord

REPRESENTATIONS = ("embeddings", "token_ids+continuous")


@dataclass(eq=False)
class Message:
    """One sender's selected positions, in original order.

    Attributes:
        rows: continuous rows. "embeddings": all [positions, hidden] selected input rows;
            "token_ids+continuous": only the rows whose token ID is -1, [continuous, hidden].
        token_ids: int64 [positions] with -1 for continuous rows ("token_ids+continuous"), or None.
        representation: "embeddings" or "token_ids+continuous".
        source: metadata about the sender's checkpoint (not payload).
        selection: the SelectionRecord when recording was on, else None (not payload).

    Treat the tensors as read-only: every receiver of a request shares them.
    """

    rows: torch.Tensor
    token_ids: torch.Tensor | None = None
    representation: str = "embeddings"
    source: dict = field(default_factory=dict)
    selection: SelectionRecord | None = None

    def __post_init__(self) -> None:
        if self.representation not in REPRESENTATIONS:
            raise ValueError(f"representation must be one of {REPRESENTATIONS}, got {self.representation!r}")
        if self.rows.dim() != 2:
            raise ValueError(f"rows must be [rows, hidden], got {tuple(self.rows.shape)}")
        if self.representation == "token_ids+continuous":
            ids = self.token_ids
            if ids is None or ids.dtype != torch.int64 or ids.dim() != 1:
                raise ValueError("a token_ids+continuous message needs int64 token_ids [positions]")
            if int((ids == -1).sum()) != self.rows.shape[0]:
                raise ValueError(f"{int((ids == -1).sum())} continuous positions but {self.rows.shape[0]} rows")
        elif self.token_ids is not None:
            raise ValueError("an embeddings message carries rows only; token_ids must be None")

    @property
    def positions(self) -> int:
        """Number of positions the message reconstructs."""
        if self.token_ids is not None:
            return int(self.token_ids.shape[0])
        return int(self.rows.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.rows.shape[1])

    @property
    def nbytes(self) -> int:
        """Tensor bytes only (rows and token IDs), without Python objects, metadata or framing."""
        n = self.rows.numel() * self.rows.element_size()
        if self.token_ids is not None:
            n += self.token_ids.numel() * self.token_ids.element_size()
        return int(n)

    def materialize(self, weight: torch.Tensor) -> torch.Tensor:
        """Rows in original order, [positions, hidden], on ``weight``'s device and dtype.

        Args:
            weight: the receiver's input embedding table [vocab, hidden] (token IDs are looked up in it).
        Raises:
            ValueError: a hidden-size mismatch or token IDs outside the table.
        """
        if weight.dim() != 2 or weight.shape[1] != self.hidden_size:
            raise ValueError(f"embedding table {tuple(weight.shape)} does not match the message's hidden size {self.hidden_size}")
        rows = self.rows.to(device=weight.device, dtype=weight.dtype)
        if self.token_ids is None:
            return rows
        ids = self.token_ids.to(weight.device)
        if ids.numel() and int(ids.max()) >= weight.shape[0]:
            raise ValueError(f"token IDs exceed the receiver's vocabulary of {weight.shape[0]}")
        if bool((ids < -1).any()):
            raise ValueError("token IDs must be -1 or non-negative")
        out = torch.empty(ids.shape[0], weight.shape[1], device=weight.device, dtype=weight.dtype)
        known = ids >= 0
        out[known] = weight[ids[known]]
        out[~known] = rows
        return out

    def __repr__(self) -> str:
        return f"Message(positions={self.positions}, representation={self.representation!r}, nbytes={self.nbytes})"


@dataclass(eq=False)
class Delivery:
    """What each receiver of one request gets.

    Attributes:
        request: the original request (string or int64 [1, tokens] IDs); metadata, not rows.
        messages: one Message per sender, in sender-list order.
    """

    request: object
    messages: tuple[Message, ...]

    @property
    def positions(self) -> int:
        return sum(m.positions for m in self.messages)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.messages)

    def rows(self, weight: torch.Tensor) -> torch.Tensor:
        """All messages materialised and concatenated in sender order: [positions, hidden]."""
        parts = [m.materialize(weight) for m in self.messages]
        if not parts:
            return weight.new_zeros(0, weight.shape[1])
        return torch.cat(parts, dim=0)

    def for_hf(self, weight: torch.Tensor) -> dict:
        """Inputs for a Hugging Face forward or generate:
        ``{"inputs_embeds": [1, positions, hidden], "attention_mask": int64 [1, positions]}``."""
        rows = self.rows(weight)
        if rows.shape[0] == 0:
            raise ValueError("the delivery holds no rows")
        return {
            "inputs_embeds": rows.unsqueeze(0),
            "attention_mask": torch.ones(1, rows.shape[0], dtype=torch.long, device=rows.device),
        }

    def for_vllm(self, weight: torch.Tensor) -> dict:
        """``{"prompt_embeds": [positions, hidden]}`` on the CPU (vLLM needs enable_prompt_embeds=True)."""
        return {"prompt_embeds": self.rows(weight).detach().to("cpu")}

    def inspect_selection(self) -> list[dict | None]:
        """Each message's selection record as JSON-serialisable data (None where not recorded)."""
        return [m.selection.inspect() if m.selection is not None else None for m in self.messages]

    def selection_html(self) -> str:
        """HTML of every message's selection, kept spans in green.

        Raises:
            ValueError: the transfer did not record selections (``record_selection=True``).
        """
        if not any(m.selection is not None for m in self.messages):
            raise ValueError("no selection was recorded; pass record_selection=True to transfer")
        request = self.request if isinstance(self.request, str) else f"<{self.request.shape[1]} token IDs>"
        blocks = [f'<div class="rclc-request"><b>Request:</b> {html.escape(str(request))}</div>']
        for i, m in enumerate(self.messages):
            if m.selection is not None:
                blocks.append(m.selection.html(title=f"Sender {i}: "))
        return '<div class="rclc-delivery">' + "".join(blocks) + "</div>"
