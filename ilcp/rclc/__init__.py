from ilcp.rclc.sender import sender_from_hf
from ilcp.rclc.state import SenderState
