"""EAGLE3 chain speculative decoding for MiniMax-M3: the worker SGLang builds for ``EAGLE3``
(``worker.py``), acceptance (``verify.py``) and the shaping of each verify row (``rows.py``)
as pure functions, and the admission check for what the chain does not apply
(``admission.py``)."""
