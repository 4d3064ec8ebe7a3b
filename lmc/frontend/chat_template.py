"""Re-exported from the protocol layer (lmc.protocol.chat_template), where the backends take it from."""
from ..protocol.chat_template import ROLES, ChatTemplate  # noqa: F401
