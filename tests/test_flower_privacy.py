"""Differential privacy, SecAgg+ and what leaves a SuperNode, on loopback (issue 23).

The cluster tests run pflalign's ClientApp under tests/spy_server.py, pflalign's ServerApp
with its Grid wrapped so that every message the ServerApp receives is kept byte for byte:
what the server holds is read off those, not assumed.
"""

from __future__ import annotations

import json
import pickle
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from pflalign import checkpoint as ckpt
from pflalign.config import build_config, make_method
from pflalign.errors import UserError
from pflalign.flower import privacy
from pflalign.flower.cluster import BIN

from test_flower import REPO, RUN_TIMEOUT, assert_close, check_closed, make_cluster, tiny

# The runs of a test start together, their ServerApps forked by pflalign-superexec, which start at
# once. (With Flower's own SuperExec, a flwr-serverapp process takes seconds to import torch, and on
# a loaded 2-core machine Flower 1.41's SuperExec kept launching more of them for the runs whose
# first process had not started yet, dozens; so these runs went one after the other until
# 2026-11-25: 8 runs 184 s, together 67 s.)
ONE_ROUND = {"rounds": 1, "eval": {"max_new_tokens": 4, "batch_size": 4, "base_model": False}}


# ---- the options and the methods they fit (no processes) ---------------------------------------
W0 = {"layer.lora_A.default.weight": torch.ones(2, 3), "layer.lora_B.default.weight": torch.ones(3, 2)}


@pytest.mark.parametrize("method, dp, needle", [
    ("scaffold", False, "two sums with different weights"),
    ("feddyn", False, "equal weights"),
    ("fedgloss", False, "unweighted sum"),
    ("local", False, "uploads nothing"),
    ("ffa-lora", True, "rather than the whole adapter"),
    ("fedsa-lora", True, "rather than the whole adapter"),
])
def test_a_method_that_needs_more_than_the_weighted_sum_is_refused_in_one_line(method, dp, needle):
    options = privacy.Privacy(noise_multiplier=1.0, clipping_norm=1.0) if dp else privacy.Privacy(secagg=True)
    cfg = build_config(None, tiny(method))
    with pytest.raises(UserError) as err:
        privacy.check(options, make_method(cfg), W0)
    text = str(err.value)
    assert "\n" not in text and f"cannot be used with method={method}: " in text and needle in text, text
    assert "docs/distributed.md" in text


def test_the_compatible_methods_are_those_whose_rule_is_a_weighted_sum():
    assert privacy.compatible(dp=True) == [
        "pflalign", "pflalign-no-precond", "pflalign-no-correction", "pflalign-const-gamma", "pflalign-hard-gamma",
        "pflalign-no-personal-init", "fedavg", "fedprox", "fedsam", "fedadam", "fedyogi", "fedadagrad"]
    assert privacy.compatible(dp=False) == privacy.compatible(dp=True) + ["ffa-lora", "fedsa-lora", "fedsvd"]
    # fedgloss without admm needs only the weighted sum, but its server sends a perturbation besides w^r
    cfg = build_config(None, {**tiny("fedgloss"), "method_args": {"admm": False}})
    assert "perturbation besides w^r" in privacy.why_not(make_method(cfg), W0, dp=False)


@pytest.mark.parametrize("method", privacy.compatible(dp=False) + ["scaffold", "feddyn", "fedgloss"])
def test_a_compatible_methods_rule_on_the_weighted_mean_is_its_rule_on_the_uploads(method):
    """The contract of `Method.needs_each_upload` returning None, which SecAgg+ and DP rely on:
    aggregate(w, [Σ_k p_k m_k], [1]) = aggregate(w, messages, p), server state included; for
    the methods that say they need each upload, it is not."""
    import copy

    from pflalign.flower.validate import expected_message
    from pflalign.methods.base import RoundContext

    torch.manual_seed(1)
    m = make_method(build_config(None, tiny(method)))
    w = {n: torch.randn_like(t) for n, t in W0.items()}
    shape = expected_message(m, w)
    messages = [{g: {n: torch.randn(s, dtype=torch.float64) for n, (s, _) in ts.items()} for g, ts in shape.items()}
                for _ in range(3)]
    weights = [0.5, 0.3, 0.2]
    w = {n: t.double() for n, t in w.items()}
    state = m.init_server_state(w)
    ctx = RoundContext(0, 4, [0, 1, 2])
    state_a, state_b = copy.deepcopy(state), copy.deepcopy(state)
    a = m.aggregate(w, messages, weights, state_a, ctx)
    b = m.aggregate(w, [privacy.weighted_mean(messages, weights)], [1.0], state_b, ctx)
    if m.needs_each_upload():  # the new adapter or the server state differs
        same = [torch.allclose(a[n], b[n], atol=1e-6) for n in a]
        same += [torch.allclose(state_a[g][n], state_b[g][n], atol=1e-6) for g in state_a for n in state_a[g]]
        assert not all(same), method
        return
    for n in a:
        assert torch.allclose(a[n], b[n], atol=1e-12), (method, n)
    for g in state_a:
        for n in state_a[g]:
            assert torch.allclose(state_a[g][n], state_b[g][n], atol=1e-12), (method, g, n)


@pytest.mark.parametrize("rc, needle", [
    ({"dp-noise-multiplier": 1.0}, "needs dp-clipping-norm > 0"),
    ({"dp-clipping-norm": -1.0}, "dp-clipping-norm must be a number >= 0"),
    ({"secagg": "yes"}, "secagg must be true or false"),
    ({"secagg-quantization-range": 1.5}, "secagg-quantization-range must be an integer"),
    ({"secagg-max-weight": 0}, "secagg-max-weight must be a number > 0"),
    ({"dp-delta": 0}, "dp-delta must be a number > 0"),
    ({"dp-delta": 1.0}, "dp-delta must be < 1"),
])
def test_bad_privacy_options_are_refused_naming_the_key(rc, needle):
    with pytest.raises(UserError, match=needle):
        privacy.from_run_config(rc)


@pytest.mark.parametrize("sigma, rounds, delta", [(1.0, 1, 1e-5), (1.0, 50, 1e-5), (4.0, 50, 1e-6), (0.7, 10, 1e-3)])
def test_epsilon_lies_between_the_gaussian_bounds(sigma, rounds, delta):
    """T Gaussian mechanisms of noise multiplier σ are ρ-zCDP with ρ = T / (2σ²), so
    ε ≤ ρ + 2 sqrt(ρ ln(1/δ)) (Bun & Steinke 2016, Prop. 1.3); and their composition is exactly
    one Gaussian mechanism of multiplier σ / sqrt(T) (Dong, Roth & Su 2019, μ-GDP), whose exact
    ε at δ (Balle & Wang 2018) no correct accountant can undercut."""
    from scipy.stats import norm
    from scipy.optimize import brentq

    eps = privacy.epsilon(sigma, rounds, delta)
    rho = rounds / (2 * sigma**2)
    assert eps <= rho + 2 * np.sqrt(rho * np.log(1 / delta)) + 1e-9
    mu = np.sqrt(rounds) / sigma  # T-fold Gaussian composition = one Gaussian of sensitivity/σ' = sqrt(T)/σ

    def delta_at(e):  # the exact δ(ε) of a Gaussian mechanism with μ = sensitivity / std
        return norm.cdf(mu / 2 - e / mu) - np.exp(e) * norm.cdf(-mu / 2 - e / mu) - delta

    exact = brentq(delta_at, 0, 200) if delta_at(0) > 0 else 0.0
    assert exact - 1e-6 <= eps, (eps, exact)
    assert eps <= 1.15 * exact  # and the RDP accountant is close to it (measured: within 5-9%)


def test_epsilon_edge_cases_and_the_report():
    assert privacy.epsilon(0.0, 3, 1e-5) == np.inf  # no noise: no guarantee
    assert privacy.epsilon(2.0, 0, 1e-5) == 0.0
    assert privacy.epsilon(2.0, 20, 1e-5) < privacy.epsilon(1.0, 20, 1e-5) < privacy.epsilon(1.0, 40, 1e-5)
    dp = privacy.Privacy(noise_multiplier=1.0, clipping_norm=0.5).report([0.1, 0.1, None])["dp"]
    assert dp["rounds_with_noise"] == 2 and dp["delta"] == 1e-5
    assert dp["epsilon"] == pytest.approx(privacy.epsilon(1.0, 2, 1e-5))
    none = privacy.Privacy(noise_multiplier=0.0, clipping_norm=0.5).report([0.0])["dp"]
    assert none["epsilon"] is None and "no finite" in none["accountant"]
    json.dumps(dp, allow_nan=False)  # results.json stays strict JSON


def test_the_dp_aggregate_applies_the_methods_rule_to_the_noised_weighted_mean():
    """With σ = 0 the mean the rule gets is the plain weighted average; with σ > 0 it moves
    by noise of std σ C max_k p_k."""
    torch.manual_seed(0)
    messages = [{"params": {n: torch.randn_like(t) for n, t in W0.items()}} for _ in range(3)]
    weights = [0.5, 0.3, 0.2]
    from pflalign.methods.base import weighted_average

    mean = privacy.weighted_mean(messages, weights)
    plain = weighted_average([m["params"] for m in messages], weights)
    assert_close(mean["params"], plain, "weighted mean")
    assert privacy.add_noise(privacy.Privacy(0.0, 1.0), mean, weights) == 0.0
    assert_close(mean["params"], plain, "no noise at sigma 0")
    big = {"params": {"x": torch.zeros(200_000)}}
    std = privacy.add_noise(privacy.Privacy(2.0, 0.1), big, weights)
    assert std == pytest.approx(2.0 * 0.1 * 0.5)
    assert float(big["params"]["x"].std()) == pytest.approx(std, rel=0.02)


# ---- the cluster --------------------------------------------------------------------------
def spy_app(root: Path) -> Path:
    """A Flower app: the spy ServerApp (tests/spy_server.py) and pflalign's ClientApp."""
    app = root / "spyapp"
    app.mkdir()
    (app / "spy_server.py").write_text((REPO / "tests" / "spy_server.py").read_text())
    pyproject = (REPO / "pyproject.toml").read_text()
    for old, new in [('serverapp = "pflalign.flower.server_app:app"', 'serverapp = "spy_server:app"'),
                     ('fab-include = ["src/pflalign/**/*.py"]', 'fab-include = ["spy_server.py"]')]:
        assert old in pyproject
        pyproject = pyproject.replace(old, new)
    (app / "pyproject.toml").write_text(pyproject)
    return app


def received(out: Path) -> list[dict]:
    return pickle.loads(out.with_name(out.name + ".received.pkl").read_bytes())


def blobs(messages: list[dict], skip_uploads: bool = False):
    """Every byte string the ServerApp received: Array data, bytes (and lists of bytes) in
    config records; with `skip_uploads`, not the method's own upload (``message/<group>``)."""
    for m in messages:
        for name, arrays in m.get("arrays", {}).items():
            if not (skip_uploads and name.startswith("message/")):
                yield from arrays.values()
        for record in m.get("configs", {}).values():
            for value in record.values():
                values = value if isinstance(value, list) else [value]
                yield from (v for v in values if isinstance(v, bytes))
        for record in m.get("metrics", {}).values():
            for value in record.values():
                values = value if isinstance(value, list) else [value]
                yield from (np.asarray(values, dtype=np.float32).tobytes(),)


def needles(tensors: dict) -> list[tuple[str, bytes]]:
    """For each tensor, 16 consecutive values as float32 bytes (as every serialisation holds them)."""
    out = []
    for name, t in tensors.items():
        flat = t.detach().float().reshape(-1)
        if flat.numel() >= 16 and bool(flat[:16].any()):
            out.append((name, flat[:16].numpy().tobytes()))
    return out


def found(messages: list[dict], tensors: dict, skip_uploads: bool = False) -> list[str]:
    """The names of `tensors` whose values occur in what the ServerApp received."""
    data = list(blobs(messages, skip_uploads))
    return [name for name, needle in needles(tensors) if any(needle in blob for blob in data)]


def client_file(state_dir: Path, out: Path, k: int, n: int = 1) -> dict:
    experiment = json.loads((out / ckpt.RESULTS).read_text())["flower"]["experiment"]
    return ckpt.load_checkpoint(state_dir / experiment / f"client-{k}" / f"round-{n}.pt")


def test_secagg_and_dp_on_loopback(tmp_path):
    """FedAvg, one round, two SuperNodes, four runs on one SuperLink: plain; SecAgg+; DP with
    noise multiplier 0 and a clipping norm above every update; DP with noise.

    * SecAgg+: the global adapter equals the plain one within the quantization error bound
      (`privacy.quantization_error`), no message the ServerApp received holds an array, and
      neither client's upload (its w_{k,T}, its personalized adapter in FedAvg) occurs in
      any byte the ServerApp received; in the plain run it does (the check can see it).
    * DP at σ = 0 with clipping inactive: the global adapter equals the plain one.
    * DP with σ > 0: results.json reports the noise level; the adapter moved by about it.
    """
    cluster = make_cluster(tmp_path, app=spy_app(tmp_path))
    base = {**tiny("fedavg"), **ONE_ROUND}
    runs = {"plain": {}, "secagg": {"secagg": True},
            "dp0": {"dp-clipping-norm": 1e3, "dp-noise-multiplier": 0.0},
            "dpnoise": {"dp-clipping-norm": 0.05, "dp-noise-multiplier": 1.0}}
    try:
        cluster.start_link()
        cluster.start_node(0)
        cluster.start_node(1)
        for name, options in runs.items():  # together: forked ServerApps start at once
            cluster.flwr_run({"set": json.dumps(base), "out": str(tmp_path / name), **options}, name)
        # a method whose rule needs each upload: refused at the start, in one line
        cluster.flwr_run({"set": json.dumps({**tiny("scaffold"), **ONE_ROUND}), "out": str(tmp_path / "refused"),
                          "secagg": True}, "refused")
        logs = {name: cluster.finish(name, RUN_TIMEOUT) for name in [*runs, "refused"]}
    finally:
        cluster.close()
    check_closed(cluster)
    for name in runs:
        assert (tmp_path / name / ckpt.RESULTS).exists(), f"{name}:\n{logs[name][-3000:]}"
    assert not (tmp_path / "refused" / ckpt.RESULTS).exists()
    assert "pflalign: error: secagg=true cannot be used with method=scaffold: its server rule needs two sums" \
        in logs["refused"], logs["refused"][-3000:]
    glob = {name: ckpt.load_checkpoint(tmp_path / name / ckpt.CHECKPOINT)["global"] for name in runs}
    results = {name: json.loads((tmp_path / name / ckpt.RESULTS).read_text()) for name in runs}
    n_train = [c["n_train"] for c in results["plain"]["clients"]]

    # SecAgg+: the aggregate within its quantization error
    uploads = [client_file(d, tmp_path / "plain", k)["personalized"]  # FedAvg: the upload is w_{k,T}
               for k, d in enumerate([cluster.state_dir(0), cluster.state_dir(1)])]
    max_abs = max(float(t.abs().max()) for upload in uploads for t in upload.values())
    bound = privacy.quantization_error(privacy.Privacy(secagg=True), n_train, max_abs)
    diff = max(float((glob["secagg"][n] - glob["plain"][n]).abs().max()) for n in glob["plain"])
    print(f"secagg: max |secagg - plain| = {diff:.3g}, bound {bound:.3g} (n_train {n_train})")
    assert diff <= bound + 1e-6, (diff, bound)
    assert results["secagg"]["flower"]["privacy"]["secagg"]["max_weight"] == 1000.0

    # ... and no individual upload reached the ServerApp
    messages = received(tmp_path / "secagg")
    assert messages and all(not arrays for m in messages for arrays in m.get("arrays", {}).values())
    plain_messages = received(tmp_path / "plain")
    for k, state_dir in enumerate([cluster.state_dir(0), cluster.state_dir(1)]):
        upload = client_file(state_dir, tmp_path / "secagg", k)["personalized"]  # FedAvg: w_{k,T}
        assert found(messages, upload) == [], f"client {k}'s upload under SecAgg+"
        plain_upload = client_file(state_dir, tmp_path / "plain", k)["personalized"]
        assert found(plain_messages, plain_upload), f"client {k}'s plain upload should be visible"

    # DP at σ = 0, clipping norm above every update: the plain result
    norms = [m["update_norm"] for m in map(json.loads, (tmp_path / "plain" / ckpt.METRICS).read_text().splitlines())
             if m["event"] == "client_round"]
    assert norms and max(norms) < 1e3
    assert_close(glob["dp0"], glob["plain"], "DP at noise multiplier 0")
    assert results["dp0"]["flower"]["privacy"]["dp"]["noise_std"] == [0.0]

    # DP with noise: the noise level is reported, and the adapter moved
    dp = results["dpnoise"]["flower"]["privacy"]["dp"]
    weights = [n / sum(n_train) for n in n_train]
    assert dp["noise_multiplier"] == 1.0 and dp["clipping_norm"] == 0.05
    assert dp["noise_std"] == [pytest.approx(1.0 * 0.05 * max(weights))]
    assert dp["rounds_with_noise"] == 1 and dp["epsilon"] == pytest.approx(privacy.epsilon(1.0, 1, dp["delta"]))
    moved = torch.cat([(glob["dpnoise"][n] - glob["plain"][n]).reshape(-1) for n in glob["plain"]])
    print(f"dp: noise std {dp['noise_std'][0]:.4g}, std of (dp - plain) {float(moved.std()):.4g}")
    assert float(moved.std()) == pytest.approx(dp["noise_std"][0], rel=0.2)


# ---- TLS and SuperNode authentication -------------------------------------------------------
def make_certificates(folder: Path) -> Path:
    """A CA, and a server certificate for 127.0.0.1 and localhost signed by it (ca.crt,
    server.pem, server.key in `folder`), as docs/distributed.md makes them with openssl."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(subject: str, key, issuer: str, issuer_key, ca: bool, san=None):
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key, server_key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca = certificate("pflalign test CA", ca_key, "pflalign test CA", ca_key, ca=True)
    server = certificate("127.0.0.1", server_key, "pflalign test CA", ca_key, ca=False,
                         san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    (folder / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "server.pem").write_bytes(server.public_bytes(serialization.Encoding.PEM))
    (folder / "server.key").write_bytes(pem_key(server_key))
    return folder


def make_node_key(path: Path) -> tuple[Path, Path]:
    """A SuperNode's key pair in OpenSSH format (as `ssh-keygen -t ecdsa -b 384` writes it)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    public = path.with_name(path.name + ".pub")
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH))
    return path, public


def test_tls_and_supernode_authentication_on_loopback(tmp_path):
    """A SuperLink with TLS and --enable-supernode-auth; two SuperNodes whose public keys were
    registered with `flwr supernode register` train a run to the end, over TLS; a SuperNode
    with an unregistered key is refused (the SuperLink never lists it, nor does the run see it)."""
    from pflalign.flower.cluster import Cluster

    tls = make_certificates(tmp_path / "certificates")
    keys = [make_node_key(tmp_path / "keys" / f"client_{k}") for k in range(2)]
    stranger, _ = make_node_key(tmp_path / "keys" / "stranger")
    cluster = Cluster(tmp_path, REPO, clients=2, tls=tls, node_auth=True,
                      env={"PFLALIGN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"})
    out = tmp_path / "out"
    try:
        cluster.start_link()
        for _, public in keys:
            cluster.register(public)
        # the stranger first: were it let in as client 0, the run would log a replacement
        try:
            cluster.start_node(0, key=stranger, name="stranger")
        except RuntimeError:
            pass  # it may exit before its own API listens: refused either way
        for k, (private, _) in enumerate(keys):
            cluster.start_node(k, key=private)
        cluster.flwr_run({"set": json.dumps({**tiny("fedavg"), **ONE_ROUND}), "out": str(out)}, "run")
        output = cluster.finish("run", RUN_TIMEOUT)
        tls_peer = tls_certificate_subject(cluster.link_port, tls / "ca.crt")
        listed = subprocess.run([str(BIN / "flwr"), "supernode", "list", "cluster", "--format", "json"],
                                env=cluster.env, cwd=tmp_path, capture_output=True, text=True).stdout
        stranger_log, link_log = cluster.log("stranger"), cluster.log("superlink")
    finally:
        cluster.close()
    check_closed(cluster)
    assert (out / ckpt.RESULTS).exists(), output[-3000:]
    results = json.loads((out / ckpt.RESULTS).read_text())
    assert [c["id"] for c in results["clients"]] == [0, 1] and results["flower"]["missing_clients"] == []
    assert "replaces SuperNode" not in output
    print("flwr supernode list:", listed[:2000])
    print("stranger's log tail:", stranger_log[-1500:])
    assert "Failed to activate SuperNode" in stranger_log, stranger_log[-3000:]
    assert "No SuperNode found with the given public key" in link_log
    assert link_log.count("[Fleet.ActivateNode] Activated node_id") == 2  # the two registered ones only
    assert tls_peer == "127.0.0.1"  # the SuperLink's port speaks TLS, with the certificate our CA signed


def tls_certificate_subject(port: int, ca: Path) -> str:
    """The common name of the certificate 127.0.0.1:`port` presents in a TLS handshake that
    trusts only `ca` (the handshake fails unless the port serves TLS with a certificate of it)."""
    import socket
    import ssl

    context = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
            subject = dict(item[0] for item in conn.getpeercert()["subject"])
    return subject["commonName"]


# ---- what leaves a SuperNode ------------------------------------------------------------------
# Round 1, each stateful method's defaults, no SecAgg+: which of a client's state groups, and
# which of its personalized adapter's tensors, occur in the bytes the ServerApp received. They
# occur only where the method's own upload carries them by design: the local model w_{k,T} (the
# personalized adapter of pFLAlign, SCAFFOLD, FedDyn, FedGloSS), SCAFFOLD's Δc (its c after a
# client's first round), FedSA-LoRA's eval_B (its own B, uploaded for the global model's
# evaluation with global_b=mean), pFLAlign's Δ = w_{k,T} − w^r (in round 1 equal to the upload's
# B matrices, since B^0 = 0). Under SecAgg+ none of them occurs. Only copies are found: a value
# the server can derive from an upload (pFLAlign's Δ in general, FedDyn's λ = −α (w_{k,T} − w^r))
# is not, which is what SecAgg+ is for.
LEAVES_BY_DESIGN = {  # method → (state groups found, personalized tensors found: "all" | "A" | "none")
    "pflalign": ({"delta"}, "all"),
    "scaffold": ({"c"}, "all"),
    "feddyn": (set(), "all"),
    "fedsa-lora": ({"B"}, "all"),
    "fedgloss": (set(), "all"),
    "local": (set(), "none"),
}


def test_what_of_a_clients_state_reaches_the_server(tmp_path):
    """Every message the ServerApp receives in a one-round run of each stateful method: no
    client's method state or personalized adapter appears anywhere but in the method's own
    upload (``message/<group>``), and there only as `LEAVES_BY_DESIGN` says; with SecAgg+
    (pFLAlign and FedSA-LoRA), nowhere at all."""
    cluster = make_cluster(tmp_path, app=spy_app(tmp_path))
    runs = {m: (m, {}) for m in LEAVES_BY_DESIGN}
    runs.update({"pflalign-secagg": ("pflalign", {"secagg": True}), "fedsa-lora-secagg": ("fedsa-lora", {"secagg": True})})
    try:
        cluster.start_link()
        cluster.start_node(0)
        cluster.start_node(1)
        for name, (method, options) in runs.items():  # together: forked ServerApps start at once
            cluster.flwr_run({"set": json.dumps({**tiny(method), **ONE_ROUND}), "out": str(tmp_path / name),
                              **options}, name)
        logs = {name: cluster.finish(name, RUN_TIMEOUT) for name in runs}
    finally:
        cluster.close()
    check_closed(cluster)
    for name, (method, options) in runs.items():
        out = tmp_path / name
        assert (out / ckpt.RESULTS).exists(), f"{name}:\n{logs[name][-3000:]}"
        messages = received(out)
        uploads = {rec for m in messages for rec in m.get("arrays", {}) if m.get("arrays", {}).get(rec)}
        assert all(rec.startswith("message/") for rec in uploads), (name, uploads)
        for k, state_dir in enumerate([cluster.state_dir(0), cluster.state_dir(1)]):
            saved = client_file(state_dir, out, k)
            state = {f"{group}/{n}": t for group, tensors in saved["state"].items() for n, t in tensors.items()}
            personal = saved["personalized"]
            assert found(messages, {**state, **personal}, skip_uploads=True) == [], (name, k)
            state_found = {key.split("/")[0] for key in found(messages, state)}
            personal_found = set(found(messages, personal))
            if options.get("secagg"):
                assert state_found == set() and personal_found == set(), (name, k, state_found, personal_found)
                continue
            groups, which = LEAVES_BY_DESIGN[method]
            assert state_found == groups, (name, k, state_found)
            visible = {n for n, _ in needles(personal)}
            expected = {"all": visible, "none": set(), "A": {n for n in visible if "lora_A" in n}}[which]
            assert personal_found == expected, (name, k, sorted(personal_found ^ expected)[:3])


def test_a_resumed_run_keeps_its_privacy_options(tmp_path):
    """The ServerApp's checkpoint holds the privacy options, they survive the checkpoint file, and a
    resume with others is refused in one line naming what changed (an older checkpoint without them
    resumes as before)."""
    from pflalign.flower.server_app import checkpoint
    from pflalign.flower.strategy import MethodStrategy
    from pflalign.run.server import Server

    started = privacy.from_run_config({"dp-clipping-norm": 1.0, "dp-noise-multiplier": 0.5})
    cfg = build_config(None, tiny("fedavg"))
    server = Server(make_method(cfg), {"w": torch.ones(2)}, 4)
    strategy = MethodStrategy(server, cfg, "e", privacy=started, names=["a", "b", "c", "d"])
    strategy.rounds_done, strategy.noise_std, strategy.n_train = {0: 1}, {0: 0.125}, {0: 10}
    ckpt.save_checkpoint(tmp_path / "c.pt", checkpoint(server, strategy))
    loaded = ckpt.load_checkpoint(tmp_path / "c.pt")
    resumed = MethodStrategy(Server(make_method(cfg), {"w": torch.zeros(2)}, 4), cfg, "new", privacy=started,
                             names=["a", "b", "c", "d"])
    resumed.load_state_dict(loaded["flower"])
    assert (resumed.experiment, resumed.rounds_done, resumed.noise_std, resumed.n_train) == \
        ("e", {0: 1}, {0: 0.125}, {0: 10})
    with pytest.raises(UserError, match="noise_multiplier 0.5 -> 0.0"):  # the ServerApp's resume refuses it
        MethodStrategy(server, cfg, "e", names=["a", "b", "c", "d"]).load_state_dict(loaded["flower"])
    saved = loaded["flower"]["privacy"]

    privacy.check_resume(saved, privacy.from_run_config({"dp-clipping-norm": 1.0, "dp-noise-multiplier": 0.5}))
    privacy.check_resume(None, privacy.from_run_config({}))
    with pytest.raises(UserError) as err:
        privacy.check_resume(saved, privacy.from_run_config({}))  # resumed without the DP keys
    assert "noise_multiplier 0.5 -> 0.0" in str(err.value) and "clipping_norm 1.0 -> 0.0" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="noise_multiplier 0.5 -> 2.0"):
        privacy.check_resume(saved, privacy.from_run_config({"dp-clipping-norm": 1.0, "dp-noise-multiplier": 2.0}))
