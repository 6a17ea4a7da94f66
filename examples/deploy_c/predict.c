/*
 * gn_mx deployment without Python: MXNet's C predict API runs a model exported from Gluon whose
 * graph contains gn_mx ops (gn_group_norm, gn_dbn_inference, gn_channel_affine).
 *
 *   predict LIBGN_MX SYMBOL_JSON PARAMS INPUT_F32 D0 [D1 ...]
 *
 *   LIBGN_MX     path of libgn_mx.so (python -c "import gn_mx; print(gn_mx.library_path())")
 *   SYMBOL_JSON  PREFIX-symbol.json written by HybridBlock.export
 *   PARAMS       PREFIX-0000.params written by HybridBlock.export (arg:/aux: keys)
 *   INPUT_F32    the input batch as raw little-endian float32, shape D0 x D1 x ... (C order)
 *
 * The op library must be loaded with MXLoadLib before MXPredCreate parses the symbol. The
 * program prints the output shape, then one output row (last dimension) per line with %.9g
 * (float32 round-trips exactly).
 *
 * Build (see README.md): cc -std=c99 predict.c -I$MX/include -L$MX -lmxnet -Wl,-rpath,$MX
 * with MX = the installed mxnet package directory.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <mxnet/c_api.h>
#include <mxnet/c_predict_api.h>

static int fail(const char* what) {
  fprintf(stderr, "predict: %s failed: %s\n", what, MXGetLastError());
  return 1;
}

/* Reads a whole file; returns NULL (and prints why) on error. */
static char* read_file(const char* path, long* size) {
  FILE* f = fopen(path, "rb");
  char* buf = NULL;
  if (!f) {
    fprintf(stderr, "predict: cannot open %s\n", path);
    return NULL;
  }
  if (fseek(f, 0, SEEK_END) == 0 && (*size = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0) {
    buf = (char*)malloc((size_t)*size + 1);
    if (buf && fread(buf, 1, (size_t)*size, f) != (size_t)*size) {
      free(buf);
      buf = NULL;
    }
  }
  fclose(f);
  if (!buf) fprintf(stderr, "predict: cannot read %s\n", path);
  else buf[*size] = '\0';
  return buf;
}

int main(int argc, char** argv) {
  if (argc < 6) {
    fprintf(stderr, "usage: %s LIBGN_MX SYMBOL_JSON PARAMS INPUT_F32 D0 [D1 ...]\n", argv[0]);
    return 2;
  }
  const char* lib = argv[1];
  uint32_t ndim = (uint32_t)(argc - 5);
  uint32_t shape[16];
  size_t count = 1;
  if (ndim > 16) {
    fprintf(stderr, "predict: at most 16 input dimensions\n");
    return 2;
  }
  for (uint32_t i = 0; i < ndim; ++i) {
    long d = strtol(argv[5 + i], NULL, 10);
    if (d <= 0) {
      fprintf(stderr, "predict: bad dimension '%s'\n", argv[5 + i]);
      return 2;
    }
    shape[i] = (uint32_t)d;
    count *= (size_t)d;
  }

  /* 1. Register the gn_mx ops with MXNet (the library may be loaded any number of times). */
  if (MXLoadLib(lib, 0) != 0) return fail("MXLoadLib");

  long json_size = 0, param_size = 0, input_size = 0;
  char* json = read_file(argv[2], &json_size);
  char* params = read_file(argv[3], &param_size);
  char* input = read_file(argv[4], &input_size);
  if (!json || !params || !input) return 1;
  if ((size_t)input_size != count * sizeof(float)) {
    fprintf(stderr, "predict: %s holds %ld bytes, the shape needs %zu\n", argv[4], input_size,
            count * sizeof(float));
    return 1;
  }

  /* 2. A CPU predictor for input "data" of the given shape. */
  const char* keys[1] = {"data"};
  uint32_t indptr[2] = {0, ndim};
  PredictorHandle pred = NULL;
  if (MXPredCreate(json, params, (int)param_size, 1 /* cpu */, 0, 1, keys, indptr, shape,
                   &pred) != 0)
    return fail("MXPredCreate");

  /* 3. One batch forward. */
  if (MXPredSetInput(pred, "data", (const float*)input, (uint32_t)count) != 0)
    return fail("MXPredSetInput");
  if (MXPredForward(pred) != 0) return fail("MXPredForward");

  uint32_t* oshape = NULL;
  uint32_t ondim = 0;
  if (MXPredGetOutputShape(pred, 0, &oshape, &ondim) != 0) return fail("MXPredGetOutputShape");
  size_t osize = 1;
  printf("output shape:");
  for (uint32_t i = 0; i < ondim; ++i) {
    printf(" %u", oshape[i]);
    osize *= oshape[i];
  }
  printf("\n");
  float* out = (float*)malloc(osize * sizeof(float));
  if (!out) return 1;
  if (MXPredGetOutput(pred, 0, out, (uint32_t)osize) != 0) return fail("MXPredGetOutput");
  size_t row = ondim ? oshape[ondim - 1] : 1;
  for (size_t i = 0; i < osize; ++i) printf(i % row == row - 1 ? "%.9g\n" : "%.9g ", out[i]);

  MXPredFree(pred);
  free(out);
  free(json);
  free(params);
  free(input);
  return 0;
}
