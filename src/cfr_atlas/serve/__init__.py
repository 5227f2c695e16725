"""The HTTP server: Ollama- and OpenAI-compatible APIs over one model, one scheduler thread.

  service.py    ServerConfig, Service (context checks, job submission) and Handle
  scheduler.py  the worker thread: bounded queue, batched steps, release on cancel
  jobs.py       generation (prompt chunks, one token per step) and embedding jobs: plan, absorb
  params.py     request validation -> GenOptions (typed errors, never a 500)
  http.py       JSON bodies, error shapes, disconnect watching, streaming
  ollama_api.py / openai_api.py   the routes; card.py the model's names and metadata
  metrics.py    /metrics (Prometheus text); app.py  create_app and the uvicorn runner
The client for Ollama-compatible servers is `cfr_atlas.ollama`, not here.
"""

from cfr_atlas.serve.app import create_app, serve
from cfr_atlas.serve.service import ServerConfig

__all__ = ["ServerConfig", "create_app", "serve"]
