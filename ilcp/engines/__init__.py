"""Serving engines other than Hugging Face transformers for the ILCP handoff.

`ilcp.engines.vllm`: the receiver decodes through a vLLM engine's ``prompt_embeds`` and the
sender can read its token states from a vLLM pooling engine (`ilcp.engines.build` builds every
engine, `ilcp.engines.engine_check` checks that it serves the LM). `ilcp.engines.served`:
receivers that hold only the LM's embedding table (`ilcp.engines.embedding_table`) and decode on
a vLLM server over HTTP, started with the command of `ilcp.engines.serve`. Importing this
package never imports vLLM; the engine classes raise ImportError with the install command when
it is absent.
"""
