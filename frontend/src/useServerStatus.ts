/** Polls GET /status (and, once a model works, /v1/models for its name) for the status panel. */

import { useCallback, useEffect, useRef, useState } from "react";
import { getLoadedModelIds, getStatus, ModelStatus, type ServerStatus } from "./api/backend";
import type { ApiClient } from "./api/client";
import { AuthCancelledError, describeError } from "./api/errors";
import { rateBetween, tokenSample, type TokenSample } from "./api/statusView";

const POLL_MS = 2000;
const POLL_WHILE_LOADING_MS = 700;

export interface ServerStatusState {
  status: ServerStatus | null;
  loadedModelId: string | null;
  /** Generated tokens per second over the last poll interval. */
  measuredRate: number | null;
  error: string | null;
  needsPassword: boolean;
  refresh: () => void;
  retryPassword: () => void;
}

export function useServerStatus(client: ApiClient): ServerStatusState {
  const [status, setStatus] = useState<ServerStatus | null>(null);
  const [loadedModelId, setLoadedModelId] = useState<string | null>(null);
  const [measuredRate, setMeasuredRate] = useState<number | null>(null);
  const lastSample = useRef<TokenSample | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [needsPassword, setNeedsPassword] = useState(false);
  const [tick, setTick] = useState(0);
  const modelKey = useRef<string>("");

  const refresh = useCallback(() => setTick((value) => value + 1), []);
  const retryPassword = useCallback(() => {
    setNeedsPassword(false);
    setTick((value) => value + 1);
  }, []);

  useEffect(() => {
    if (needsPassword) return;
    let timer: ReturnType<typeof setTimeout> | undefined;
    const controller = new AbortController();
    const poll = async (): Promise<void> => {
      let next = POLL_MS;
      try {
        const current = await getStatus(client, controller.signal);
        setStatus(current);
        const sample = tokenSample(current, performance.now());
        setMeasuredRate(rateBetween(lastSample.current, sample));
        lastSample.current = sample;
        setError(null);
        if (current.status === ModelStatus.Loading) next = POLL_WHILE_LOADING_MS;
        // The model's name changes only when the loaded model does: look it up once per load.
        const key = current.status === ModelStatus.Working ? `${current.pid}|${current.strategy}|${current.model ?? ""}` : "";
        if (key !== modelKey.current) {
          modelKey.current = key;
          setLoadedModelId(key === "" ? null : ((await getLoadedModelIds(client))[0] ?? null));
        }
      } catch (caught) {
        if (controller.signal.aborted) return;
        if (caught instanceof AuthCancelledError) {
          setNeedsPassword(true);
          return;
        }
        setError(describeError(caught));
      }
      if (!controller.signal.aborted) timer = setTimeout(() => void poll(), next);
    };
    void poll();
    return () => {
      controller.abort();
      clearTimeout(timer);
    };
  }, [client, tick, needsPassword]);

  return { status, loadedModelId, measuredRate, error, needsPassword, refresh, retryPassword };
}
