"""`deepspeed.runtime.*`: the module paths scripts import DeepSpeed's runtime names from."""
