"""Models: checkpoint loading, the slot KV cache, the decoder implementations, GGUF files and the
registry of model references (above kernels/, below the services).

``loader.load_model(dir)`` turns a Hugging Face checkpoint directory (safetensors) into a
``base.CausalLM`` whose ``forward(input_ids, cache, slots, start_pos)`` reads and writes a
``kv_cache.KVCache`` made by ``model.new_cache``; ``random_init.write_random_checkpoint`` makes a
small random Llama checkpoint for demos and tests; ``registry.resolve_model`` turns a model name,
a GGUF file or a directory into a checkpoint directory (``gguf`` converts; ``cache`` says where).

Importing this package imports nothing: the gateway resolves its tokenizer through ``registry``
without loading torch. What it does not know: tokenizers' use, sampling, verification,
scheduling or transport.
"""
