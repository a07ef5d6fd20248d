"""The model graph (layers calling backend kernels), architectures and weight loaders.

Entry points: :func:`plinth.model.loader.resolve_model`, :func:`plinth.model.loader.load_model`,
:func:`plinth.model.loader.load_tokenizer`.
"""
