# The router's image: `make image` builds it (docker build -t trio-pd:latest .). The Kubernetes
# manifests of docs/operations.md and docs/scaling-out.md run it as `trio-pd <args>`, and
# tests/test_deployment.py holds their args to this ENTRYPOINT and to the router's parser.
FROM python:3.11-slim
WORKDIR /opt/trio_pd
COPY pyproject.toml README.md ./
COPY trio_pd ./trio_pd
RUN pip install --no-cache-dir . && useradd --uid 65532 --no-create-home router
USER 65532
EXPOSE 30000
ENTRYPOINT ["trio-pd"]
CMD ["serve", "--help"]
