"""The control plane's routes: worker membership (`/workers`) and the endpoints answered by
asking workers (fan-out: `/get_loads`, `/flush_cache`, `/v1/models`, server and model info)."""
