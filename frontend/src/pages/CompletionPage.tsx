import { useEffect, useReducer, useRef, useState } from "react";
import {
  Button,
  Card,
  Field,
  Input,
  MessageBar,
  MessageBarBody,
  MessageBarTitle,
  Textarea,
  Title3,
} from "@fluentui/react-components";
import { isAbortError } from "../api/errors";
import { streamBatch, streamCompletion, type StreamOutcome } from "../api/streams";
import { batchReducer, deltasFromChunk, initialBatchState, MAX_BATCH_COUNT, type BatchDelta } from "../batch/batchState";
import type { PageProps } from "./pageProps";
import { parseWholeNumber } from "../config/strategy";
import { useT } from "../i18n/I18nContext";
import { BatchStrip } from "../components/BatchStrip";
import { SamplingForm } from "../components/SamplingForm";
import { UsageLine } from "../components/UsageLine";
import { useErrorText } from "../components/useErrorText";

// Batch news is applied to React state at most this often, so 1000 streams do not mean 1000 renders.
const BATCH_FLUSH_MS = 80;

export function CompletionPage({
  client,
  settings,
  update,
}: PageProps) {
  const t = useT();
  const errorText = useErrorText();
  const [generating, setGenerating] = useState(false);
  const [outcome, setOutcome] = useState<StreamOutcome | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [countText, setCountText] = useState(String(settings.batchCount));
  const [batch, dispatch] = useReducer(batchReducer, initialBatchState);
  const single = useRef<AbortController | null>(null);
  const batchAbort = useRef<AbortController | null>(null);
  const pending = useRef<BatchDelta[]>([]);
  const flushTimer = useRef<ReturnType<typeof setTimeout> | undefined>(undefined);
  const prompt = useRef(settings.completionPrompt);
  prompt.current = settings.completionPrompt;

  useEffect(() => () => clearTimeout(flushTimer.current), []);

  const batchRunning = batch.phase === "generating";
  const count = parseWholeNumber(countText);
  const countValid = count >= 1 && count <= MAX_BATCH_COUNT;

  const generate = async () => {
    const abort = new AbortController();
    single.current = abort;
    setGenerating(true);
    setError(null);
    // The reply is written into the editor as it arrives, as in a text editor's autocomplete.
    let text = settings.completionPrompt;
    try {
      const result = await streamCompletion(client, text, settings.completionSampling, abort.signal, (delta) => {
        text += delta;
        update({ completionPrompt: text });
      });
      setOutcome(result);
    } catch (caught) {
      if (!isAbortError(caught)) setError(errorText(caught));
    } finally {
      single.current = null;
      setGenerating(false);
    }
  };

  const flush = () => {
    flushTimer.current = undefined;
    const deltas = pending.current;
    pending.current = [];
    if (deltas.length > 0) dispatch({ type: "deltas", deltas });
  };

  const startBatch = async () => {
    if (!countValid) return;
    const abort = new AbortController();
    batchAbort.current = abort;
    pending.current = [];
    setError(null);
    dispatch({ type: "start", count });
    try {
      await streamBatch(client, prompt.current, count, settings.completionSampling, abort.signal, (payload) => {
        pending.current.push(...deltasFromChunk(payload));
        flushTimer.current ??= setTimeout(flush, BATCH_FLUSH_MS);
      });
      clearTimeout(flushTimer.current);
      flush();
      dispatch({ type: "completed" });
    } catch (caught) {
      clearTimeout(flushTimer.current);
      flush();
      if (isAbortError(caught)) dispatch({ type: "stopped" });
      else dispatch({ type: "failed", message: errorText(caught) });
    } finally {
      batchAbort.current = null;
    }
  };

  return (
    <div style={{ display: "flex", gap: 16, alignItems: "flex-start" }}>
      <div style={{ flexGrow: 1, display: "flex", flexDirection: "column", gap: 12, minWidth: 0 }}>
        {batch.phase !== "idle" && <BatchStrip batch={batch} />}
        <Field label={t("completionPrompt")}>
          <Textarea
            resize="vertical"
            rows={16}
            value={settings.completionPrompt}
            onChange={(_, data) => update({ completionPrompt: data.value })}
            disabled={generating}
            data-testid="completion-prompt"
            textarea={{ style: { fontFamily: "monospace", maxHeight: "none" } }}
          />
        </Field>
        {error && (
          <MessageBar intent="error" layout="multiline" data-testid="completion-error">
            <MessageBarBody>
              <MessageBarTitle>{t("requestFailed")}</MessageBarTitle>
              <span style={{ whiteSpace: "pre-wrap" }}>{error}</span>
            </MessageBarBody>
          </MessageBar>
        )}
        <div style={{ display: "flex", gap: 8, alignItems: "center", flexWrap: "wrap" }}>
          <Button appearance="primary" disabled={generating || batchRunning} onClick={() => void generate()} data-testid="completion-generate">
            {t("completionGenerate")}
          </Button>
          <Button disabled={!generating} onClick={() => single.current?.abort()} data-testid="completion-stop">
            {t("completionStop")}
          </Button>
          <UsageLine outcome={outcome} testId="completion-usage" />
        </div>
        <Card>
          <Title3>{t("completionBatch")}</Title3>
          <div style={{ display: "flex", gap: 8, alignItems: "end", flexWrap: "wrap" }}>
            <Field
              label={t("completionBatchCount")}
              validationState={countValid ? "none" : "error"}
              validationMessage={countValid ? undefined : t("configsRangeHint", { min: 1, max: MAX_BATCH_COUNT })}
            >
              <Input
                type="number"
                min={1}
                max={MAX_BATCH_COUNT}
                value={countText}
                data-testid="batch-count"
                onChange={(_, data) => {
                  setCountText(data.value);
                  const value = parseWholeNumber(data.value);
                  if (value >= 1 && value <= MAX_BATCH_COUNT) update({ batchCount: value });
                }}
              />
            </Field>
            <Button
              appearance="primary"
              disabled={!countValid || batchRunning || generating}
              onClick={() => void startBatch()}
              data-testid="batch-start"
            >
              {t("completionBatchStart")}
            </Button>
            <Button disabled={!batchRunning} onClick={() => batchAbort.current?.abort()} data-testid="batch-stop">
              {t("completionBatchStop")}
            </Button>
            <Button disabled={batchRunning || batch.phase === "idle"} onClick={() => dispatch({ type: "clear" })}>
              {t("completionBatchClear")}
            </Button>
          </div>
        </Card>
      </div>
      <Card style={{ width: 220, flexShrink: 0 }}>
        <Title3>{t("samplingTitle")}</Title3>
        <SamplingForm
          value={settings.completionSampling}
          onChange={(next) => update({ completionSampling: next })}
          testIdPrefix="completion"
        />
      </Card>
    </div>
  );
}
