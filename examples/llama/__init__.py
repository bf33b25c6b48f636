"""Example Llama-family runner on jax_kvcm (model, loader, paged driver, serving loop, HTTP
server); run `python -m examples.llama.run` or `python examples/llama/run.py`."""
