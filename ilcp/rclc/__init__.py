"""RCLC: hand a budgeted selection of a sender's input-embedding rows to receivers.

    from ilcp import rclc
    sender = rclc.sender_from_hf(model, tokenizer, sender_messages)
    receiver = rclc.HFReceiver(model, tokenizer, messages=receiver_history, max_new_tokens=128)
    rclc.transfer_sync(sender, receiver, "Who owns Cedar?")      # or: await rclc.transfer(...)
    tokens = model.generate(**receiver.pop(), do_sample=False)

Bound agents (`bind` = `Agent`) wrap the same pieces for an existing agent loop:

    agent_x = rclc.bind(model, tokenizer, messages=history_x)
    agent_y = rclc.bind(model, tokenizer, messages=history_y)
    await rclc.transfer(agent_x, agent_y, question)
    answers = await agent_y.ask(["Who owns Cedar?", "Where is it kept?"])  # consumes nothing
    inputs = agent_y.pop()
    agent_y.update(inputs=inputs, generation=model.generate(**inputs, return_dict_in_generate=True))

`check` and ``python -m ilcp.rclc doctor`` report the environment. Nothing here runs at import
time.
"""

from ilcp.rclc import budget, selectors
from ilcp.rclc import vllm as _vllm_adapter  # noqa: F401  (registers backend="vllm"; does not import vLLM)
from ilcp.rclc.agent import Agent, bind
from ilcp.rclc.backends import BackendUnavailableError
from ilcp.rclc.check import check
from ilcp.rclc.message import Delivery, Message
from ilcp.rclc.reasoning import latent_mass, latent_mass_sync
from ilcp.rclc.receiver import DEFAULT_SLOT_TEMPLATE, HFReceiver
from ilcp.rclc.record import SelectionRecord
from ilcp.rclc.sender import sender_from_hf
from ilcp.rclc.snapshot import SnapshotError
from ilcp.rclc.state import SenderState
from ilcp.rclc.transfer import transfer, transfer_sync
from ilcp.rclc.vllm import discard_capture, request_capture, sender_from_vllm

__all__ = [
    "Agent",
    "BackendUnavailableError",
    "DEFAULT_SLOT_TEMPLATE",
    "Delivery",
    "HFReceiver",
    "Message",
    "SelectionRecord",
    "SenderState",
    "SnapshotError",
    "bind",
    "budget",
    "check",
    "discard_capture",
    "latent_mass",
    "latent_mass_sync",
    "request_capture",
    "selectors",
    "sender_from_hf",
    "sender_from_vllm",
    "transfer",
    "transfer_sync",
]
