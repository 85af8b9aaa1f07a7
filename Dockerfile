# moeflash in a container: the same `make setup` as the README, a portable CPU build, a non-root
# user, and a LAN-facing server that refuses to start without an API key (make serve-container).
#
#   docker build -t moeflash .
#   docker run --rm -p 8000:8000 -e MOEFLASH_API_KEY=... -v /path/to/models:/models \
#       -e MODEL=/models/model.gguf moeflash
# Without MODEL the built-in demo model is served.
FROM python:3.11-slim-bookworm

# compilers for llama.cpp and streaming_ext; patch applies vendor/llama.cpp/patches
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential=12.9 cmake=3.25.1-1 make=4.3-4.1 patch=2.7.6-7 \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 moeflash
USER 10001
WORKDIR /home/moeflash/app

# portable: the image may run on any CPU of its architecture, not only the one that built it
ENV MOEFLASH_CPU=portable \
    PYTHONUNBUFFERED=1

COPY --chown=10001:10001 . .
RUN make setup demo-model

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["/home/moeflash/app/.venv/bin/python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
CMD ["make", "serve-container"]
