"""The sender's side: what writes the memory a receiver reads.

- `ilcp.encoder.pooling`: the sender LM's token states and the poolers over them;
- `ilcp.encoder.slots`: memory slots (learned tokens after the context, optional low-rank adapters);
- `ilcp.encoder.compressor`: the beta-VAE; its mean z is what crosses the wire;
- `ilcp.encoder.projector`: the gated MLP that turns z into K memory vectors on the receiver;
- `ilcp.encoder.kinds`: the memory kinds, each its own settings (`compressor.memory`), and their registry;
- `ilcp.encoder.slot_memory`: the memory-slot kind's settings;
- `ilcp.encoder.spec`: `EncoderSpec`, the typed settings an export records;
- `ilcp.encoder.model`: `ILCPEncoder`, the modules together;
- `ilcp.encoder.send`: `Sender`, a context's text -> states -> latents -> payload.
"""
