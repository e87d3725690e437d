"""sglang-m3: MiniMax-M3 for stock SGLang, loaded through the ``sglang.srt.plugins`` entry point.

Importing this package is cheap (no SGLang, no torch); ``plugin.register`` does the wiring.
"""

__version__ = "0.1.0"
