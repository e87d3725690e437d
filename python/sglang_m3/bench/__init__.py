"""Accuracy and serving benchmarks that talk to any running OpenAI-compatible
server (SGLang's or anyone's) over HTTP.

Deliberately independent of the model code: nothing here imports ``sglang``
or ``torch``, so the same scripts measure our plugin and a reference server.
Each benchmark module exposes ``main(argv) -> dict`` returning its summary.
"""
