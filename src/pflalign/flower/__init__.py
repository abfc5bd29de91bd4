"""pflalign on Flower: every method on real processes and machines, with the
same client and server code as the in-process engine. This package sits
beside `pflalign.run.engine`, not above it: both use `pflalign.run.client` (the
client side), `pflalign.run.server` (the server side) and `pflalign.run.lifecycle`
(the run folder).

* `server_app.app` (a Flower ``ServerApp``) runs the rounds (its `train`
  loop) with `strategy.MethodStrategy`, a Flower strategy around the run's
  `pflalign.run.server.Server` (the method's server rule, w^r, the server
  state): it broadcasts w^r (plus ``Server.broadcast``), collects and checks
  the clients' messages and aggregates them on the server with data-size
  weights (``Server.start_round``, ``finish_round``). It writes the run
  directory with the same `pflalign.run.lifecycle.Recorder` as ``pflalign run``.
* `client_app.app` (a Flower ``ClientApp``) is one client: it loads its own
  partition (node config ``partition-id``), keeps its method state in a file
  on its own host, and runs `pflalign.run.client.train_client`.
* `wire` is what crosses the wire: LoRA tensors as ArrayRecords, and the
  run configuration.
* `cluster` starts a SuperLink, SuperNodes and `flwr run` as processes on
  127.0.0.1 and stops them all again (the tests and benchmarks/engines.py).

Components for ``[tool.flwr.app.components]`` (see pyproject.toml and
docs/distributed.md): ``pflalign.flower.server_app:app`` and
``pflalign.flower.client_app:app``.
"""


def quiet_progress_bars() -> None:
    """Switch transformers' progress bars off in this process, and with them the GGUF
    de-quantization bar (pflalign.model.model_cache follows the same switch): the apps' output is a
    log (the SuperNode's, the ServerApp's), where a bar is only carriage-return noise. Called
    by the apps before they build the model, not on import: importing transformers costs
    seconds, which a ClientApp process that answers a ``query`` should not pay."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
