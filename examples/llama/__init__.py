"""Example Llama-family runner on jax_kvcm (model, loader, paged driver)."""
