"""Hugging Face transformers models as chains: the wrappers each part of a model
becomes (:mod:`.layers`) and, per family, where its parts are (:mod:`.recipes`).
:func:`harmony.engine.decompose_hf.split` puts them together and checks the chain."""
