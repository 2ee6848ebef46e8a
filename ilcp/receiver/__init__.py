"""The receiver's side: what reads the memory.

- `ilcp.receiver.receive`: `Receiver`, bytes -> one checked latent -> memory vectors -> answer;
- `ilcp.receiver.memory`: `ReceivedMemory`, a payload opened once and asked many questions;
- `ilcp.receiver.questions`: what a receive checks of its questions and settings before it opens;
- `ilcp.receiver.stem_decoding`: greedy decoding after the cached part every question shares;
- `ilcp.receiver.prefix`: the one builder of the receiver's input (memory, prompt, placement);
- `ilcp.receiver.prompts`, `ilcp.receiver.rclc_prompts`: the prompt templates;
- `ilcp.receiver.decoding`: batched greedy decoding with a cache.
"""
