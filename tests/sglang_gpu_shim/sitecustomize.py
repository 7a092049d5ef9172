"""Installs the stand-ins' import hooks in every process started with this directory on PYTHONPATH
(SGLang's scheduler and detokenizer are processes of their own)."""

import _sglang_standins

_sglang_standins.install()
