"""Test doubles that are not part of the product: the full fake vLLM (``fake_vllm.py``, run as ``vllm``)."""
