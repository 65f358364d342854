"""Engram inside other frameworks.

``engram.integrations.transformers``: DeepSeek-V4.1's Engram layers on 🤗 transformers'
``DeepseekV4ForCausalLM`` (:func:`~engram.integrations.transformers.attach_engram`,
:func:`~engram.integrations.transformers.load_model`). Submodules import their
framework only when used (importing them is cheap).
"""

from engram.integrations import transformers

__all__ = ["transformers"]
