"""Megatron-Core on rankctl's process groups (``pip install 'rankctl[megatron]'``)."""
