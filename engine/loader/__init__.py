"""From files to a ready model: configs, weight loaders, the tokenizer and its chat template.

Every weight loader yields ``(hf_name, tensor)`` pairs in Hugging Face parameter names and layout, whatever
the file format: ``source`` resolves what ``--model`` points at, ``hf`` reads a Hugging Face folder, ``gguf``
a llama.cpp GGUF file (dequantized, llama q/k un-permuted), ``dummy`` makes random weights for a config or a
preset; ``model_loader`` puts them together into a model and its tokenizer. Their errors are in
``engine.errors``.
"""
