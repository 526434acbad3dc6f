"""Federated LoRA over Flower: ``lora`` (numpy math), ``strategy`` (LoraFedAvg), ``ledger``, the apps.

Import explicitly (``import lorad.client.federated.strategy``): ``lorad.client`` never imports this package, so the
SDK stays free of numpy and flwr. Needs ``pip install 'lorad[federated]'``.
"""
