import os

# Tests must never try to reach wandb's servers, and share one tokenization cache per checkout.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("ASYNCPP_CACHE", os.path.join(os.path.dirname(os.path.dirname(__file__)), ".cache", "asyncpp"))
