# syntax=docker/dockerfile:1
# The gpufeed image: `gpufeed worker`, `gpufeed beat` and every other command (see compose.yaml).
# Pillow-SIMD is compiled in a build stage against libjpeg-turbo, zlib, libwebp, libtiff and
# openjpeg, as scripts/setup.sh does on a workstation; the runtime stage keeps only the libraries.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS pillow-simd
ARG PILLOW_SIMD_VERSION=12.1.1.post0
# -mavx2 suits every x86 server of the last decade; build with SIMD_CFLAGS=-msse4 for older CPUs.
ARG SIMD_CFLAGS=-mavx2
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libjpeg62-turbo-dev zlib1g-dev libwebp-dev \
      libtiff-dev liblcms2-dev libopenjp2-7-dev libfreetype-dev \
 && rm -rf /var/lib/apt/lists/*
RUN CC="cc ${SIMD_CFLAGS}" pip wheel --no-deps --no-cache-dir --no-binary pillow-simd \
      "pillow-simd==${PILLOW_SIMD_VERSION}" -w /wheels
# The loader's region JPEG decoder and resampler, built here where the compiler and headers are: the
# runtime image finds it in GPUFEED_CACHE and needs neither.
COPY pipeline/native.py pipeline/jpegregion.c pipeline/resample.c /src/pipeline/
RUN cd /src && GPUFEED_CACHE=/gpufeed-cache python -c \
      "from pipeline import native; assert native.library() is not None, native.problem()"

FROM ${PYTHON_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends libjpeg62-turbo zlib1g libwebp7 libwebpmux3 libwebpdemux2 \
      libtiff6 liblcms2-2 libopenjp2-7 libfreetype6 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/gpufeed
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY worker ./worker
# The CPU build of torch first, so resolving gpufeed keeps it instead of a multi-GB CUDA build.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch>=2.1" \
 && pip install --no-cache-dir . \
 && pip uninstall -y pillow
COPY --from=pillow-simd /wheels /tmp/wheels
COPY --from=pillow-simd /gpufeed-cache /opt/gpufeed-cache
RUN pip install --no-cache-dir --no-deps /tmp/wheels/pillow_simd-*.whl && rm -rf /tmp/wheels \
 && useradd --create-home --uid 10001 gpufeed \
 && mkdir -p /data /shards && chown gpufeed /shards
USER gpufeed
ENV PYTHONUNBUFFERED=1 \
    GPUFEED_ALLOWED_ROOTS=/data:/shards \
    GPUFEED_CACHE=/opt/gpufeed-cache
CMD ["gpufeed", "worker"]
