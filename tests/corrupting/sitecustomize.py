"""Makes the server process it is loaded into return wrong hidden states: every block adds 0.05 to its output.

A spot-check test puts this folder first on a server's PYTHONPATH (Python imports `sitecustomize` at start); the
product has no such switch."""

from swarm.model import decoder

_finish = decoder.DecoderBlock.finish


def _corrupt_finish(self, hidden, attended):  # type: ignore[no-untyped-def]
    return _finish(self, hidden, attended) + 0.05


decoder.DecoderBlock.finish = _corrupt_finish  # type: ignore[method-assign]
