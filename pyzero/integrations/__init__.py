"""pyzero inside other training frameworks.

``pyzero.integrations.hf``: transformers.Trainer and accelerate (imports both; the rest of pyzero
does not need them). ``pyzero.integrations.lightning``: PyzeroStrategy for lightning.Trainer
(imports lightning).
"""
