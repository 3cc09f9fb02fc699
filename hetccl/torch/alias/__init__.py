"""Start-up hook folder for `hetccl run --torch-backend-alias` (see sitecustomize.py)."""
