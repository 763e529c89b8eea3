"""CDI (Container Device Interface) specs: what the container runtime adds to a container for the
devices of a prepared DRA claim."""

from edl_agent.cdi.spec import CDI_VERSION, Grant, claim_cdi_id, claim_spec, vendor_spec
from edl_agent.cdi.writer import CdiWriter

__all__ = [
    "CDI_VERSION",
    "CdiWriter",
    "Grant",
    "claim_cdi_id",
    "claim_spec",
    "vendor_spec",
]
