"""kda-export: turn a model that uses kda_ops into deployable artifacts, and check each one.

``python -m export --tiny --out out/`` (see export/README.md). The pieces:

* :mod:`export.artifacts` -- the prefill / decode graphs of a model and the writers (.pt2, AOTInductor, ONNX);
* :mod:`export.runtime` -- loading an artifact as a plain callable, greedy generation, and the fresh-process
  runner the verification uses (``python -m export.runtime``);
* :mod:`export.__main__` -- the command line.
"""
