"""The ``m3_msa`` attention backend: per-batch plan + per-layer MSA launches."""
