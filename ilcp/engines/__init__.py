"""Serving engines other than Hugging Face transformers for the ILCP handoff.

`ilcp.engines.vllm`: the receiver decodes through a vLLM engine's ``prompt_embeds`` and the
sender can read its token states from a vLLM pooling engine. `ilcp.engines.served`: receivers
that hold only the LM's embedding table and decode on a vLLM server over HTTP. Importing this
package never imports vLLM; the engine classes raise ImportError with the install command when
it is absent.
"""
