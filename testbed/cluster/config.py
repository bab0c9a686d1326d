"""The cluster's settings are the control plane's (testbed/control/config.py): both executors read them."""

from testbed.control.config import DISPATCH, ClusterConfig, KVFailurePolicy, KVTransferConfig, device_ref

__all__ = ["DISPATCH", "ClusterConfig", "KVFailurePolicy", "KVTransferConfig", "device_ref"]
