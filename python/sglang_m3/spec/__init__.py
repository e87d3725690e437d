"""EAGLE3 chain speculative decoding for MiniMax-M3: the worker SGLang builds for ``EAGLE3``
(``worker.py``), acceptance as pure functions (``verify.py``) and the admission check for
sampling features the chain does not apply (``admission.py``)."""
