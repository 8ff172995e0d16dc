"""Job kinds as plugins: ``registry`` (``JobKind``, discovery), ``spec`` (the typed job spec), one folder per kind."""
