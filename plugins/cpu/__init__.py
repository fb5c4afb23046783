"""trtforge."""
