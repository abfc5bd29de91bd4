"""A ClientApp for tests/test_flower.py only: pflalign's ClientApp, except that the client
with partition-id 1 corrupts its training update, one attack per round (0-based r):
0 wrong shapes, 1 a NaN, 2 a missing tensor, 3 the update (w_k − w^r) 1e6 times too large,
4 an honest update that claims 10^12 training examples (its aggregation weight); and its
evaluation reply claims 10^9.

The test copies this file into a Flower app folder whose pyproject.toml names
``malicious_client:app`` as the ClientApp (the ServerApp stays pflalign's)."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from pflalign.flower import client_app, wire

app = ClientApp()
MALICIOUS = 1


def corrupt(params: dict, global_params: dict, r: int) -> dict:
    first = sorted(params)[0]
    if r == 0:
        params[first] = params[first][:-1]  # one row short
    elif r == 1:
        params[first] = params[first].clone()
        params[first].view(-1)[0] = float("nan")
    elif r == 2:
        del params[first]
    else:
        params = {n: global_params[n] + 1e6 * (t - global_params[n]) for n, t in params.items()}
    return params


@app.query()
def query(msg: Message, context: Context) -> Message:
    return client_app.query(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    reply = client_app.train(msg, context)
    r = int(msg.content["config"]["round"])
    if int(context.node_config["partition-id"]) == MALICIOUS and r >= 4:
        reply.content["metrics"]["n_train"] = 10**12
    elif int(context.node_config["partition-id"]) == MALICIOUS:
        key = wire.MESSAGE + "params"
        params = wire.from_record(reply.content[key], None)  # a well-formed record of corrupt tensors
        global_params = wire.from_record(msg.content[wire.GLOBAL], None)
        reply.content[key] = wire.to_record(corrupt(params, global_params, r))
    return reply


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    reply = client_app.evaluate(msg, context)
    if int(context.node_config["partition-id"]) == MALICIOUS:
        reply.content["metrics"]["n_train"] = 10**9
    return reply
