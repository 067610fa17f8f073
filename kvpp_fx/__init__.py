"""kvpp-fx: KV layer parallelism (KVPP) for MLA/SFA models as a torch.fx pass plus a small runtime."""

__version__ = "0.1.0"
