"""What a method is configured with: the typed settings schema and its checks (`params.py`), and the
policy that turns an `auto` size into a number for this machine and a batch (`sizing.py`). Neither
runs a model; the engine and the methods read them."""
