"""FedAvg (McMahan et al., AISTATS 2017, "Communication-Efficient Learning of Deep
Networks from Decentralized Data").

Client: T steps of plain SGD, w ← w − η g (no momentum), from w^r.
Server: w^{r+1} = Σ_k (|D_k| / Σ_j |D_j|) w_k.
Personalized model of client k: its locally trained w_k of the last round.
"""

from .base import Method


class FedAvg(Method):
    name = "fedavg"
    label = "FedAvg"
    family = "Optimizer-based"
