import { describe, expect, it } from "vitest";
import { ModelStatus, type ServerStatus } from "../../src/api/backend";
import { rateBetween, statusView, tokenSample } from "../../src/api/statusView";

const albatross: ServerStatus = {
  status: ModelStatus.Working,
  pid: 7,
  device_name: "NVIDIA H200",
  backend: "albatross",
  strategy: "albatross workers=2 batch=64",
  model: "rwkv7-g1-2.9b",
  effective: { worker_num: 2, batch_size: 64, active_slots: 17, generated_tokens_total: 1200 },
};

describe("statusView", () => {
  it("reads the loaded model, backend and the effective workers, batch and active slots", () => {
    expect(statusView(albatross, null)).toEqual({
      state: "working",
      model: "rwkv7-g1-2.9b",
      backend: "albatross",
      strategy: "albatross workers=2 batch=64",
      device: "NVIDIA H200",
      workers: 2,
      batch: 64,
      activeSlots: 17,
      tokensPerSecond: null,
    });
  });

  it("maps the runner's status codes to offline, loading and working", () => {
    expect(statusView({ status: ModelStatus.Offline }, null).state).toBe("offline");
    expect(statusView({ status: ModelStatus.Loading }, null).state).toBe("loading");
  });

  it("falls back to the /v1/models id for the name only while a model works", () => {
    expect(statusView({ status: ModelStatus.Working, model: null }, "tiny").model).toBe("tiny");
    expect(statusView({ status: ModelStatus.Offline, model: null }, "tiny").model).toBeNull();
  });

  it("prefers a rate the backend reports over the measured one", () => {
    const reported = { ...albatross, effective: { tokens_per_second: 512.5 } };
    expect(statusView(reported, null, 10).tokensPerSecond).toBe(512.5);
    expect(statusView(albatross, null, 10).tokensPerSecond).toBe(10);
  });
});

describe("token rate between polls", () => {
  it("divides the generated tokens by the seconds between the samples", () => {
    const first = tokenSample(albatross, 1000);
    const second = tokenSample({ ...albatross, effective: { generated_tokens_total: 1500 } }, 3000);
    expect(rateBetween(first, second)).toBe(150);
  });

  it("is unknown without a previous sample, without a counter, or when the counter restarts", () => {
    const later = tokenSample(albatross, 2000);
    expect(rateBetween(null, later)).toBeNull();
    expect(tokenSample({ status: ModelStatus.Working, effective: {} }, 0)).toBeNull();
    expect(rateBetween({ total: 5000, atMs: 0 }, later)).toBeNull();
  });
});
