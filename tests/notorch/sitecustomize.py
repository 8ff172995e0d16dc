"""Put on PYTHONPATH, this makes the interpreter behave as if torch were not installed (a client-only venv):
importing or looking up ``torch`` raises ModuleNotFoundError. tests/e2e/test_client_without_torch.py uses it."""

import sys


class _NoTorch:
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 - importlib's finder protocol
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoTorch())
