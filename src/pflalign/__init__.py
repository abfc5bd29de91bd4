"""pflalign: personalized federated LoRA fine-tuning of language models.

pFLAlign (Kim & Lee, 2026) and the baselines it is compared with, on one
in-process engine; see README.md.
"""

__version__ = "0.1.0"
