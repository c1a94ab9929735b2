import { useCallback, useEffect, useState } from "react";
import {
  Button,
  Card,
  Field,
  Input,
  MessageBar,
  MessageBarBody,
  MessageBarTitle,
  Select,
  Spinner,
  Text,
  Title3,
} from "@fluentui/react-components";
import { getLocalModels, switchModel, updateConfig, type LocalModel } from "../api/backend";
import { ApiError } from "../api/errors";
import { useErrorText } from "../components/useErrorText";
import { statusView } from "../api/statusView";
import type { PageProps } from "./pageProps";
import {
  BATCH_RANGE,
  buildStrategy,
  DEVICES,
  parseWholeNumber,
  usesWorkersAndBatch,
  WORKERS_RANGE,
  type Device,
} from "../config/strategy";
import { followServerDevice } from "../config/settings";
import { useT } from "../i18n/I18nContext";
import type { StringKey } from "../i18n/strings";
import { SamplingForm } from "../components/SamplingForm";
import { shownState, StateBadge } from "../components/StateBadge";
import type { ServerStatusState } from "../useServerStatus";

const DEVICE_LABELS: Record<Device, StringKey> = { cpu: "deviceCpu", cuda: "deviceCuda", albatross: "deviceAlbatross" };

type Notice = { intent: "success" | "error"; title: string; text: string } | null;

export function ConfigsPage({
  client,
  settings,
  update,
  server,
}: PageProps & { server: ServerStatusState }) {
  const t = useT();
  const errorText = useErrorText();
  const [models, setModels] = useState<LocalModel[] | null>(null);
  const [modelsError, setModelsError] = useState<string | null>(null);
  const [workersText, setWorkersText] = useState(String(settings.workers));
  const [batchText, setBatchText] = useState(String(settings.batch));
  const [loading, setLoading] = useState(false);
  const [loadNotice, setLoadNotice] = useState<Notice>(null);
  const [defaultsNotice, setDefaultsNotice] = useState<Notice>(null);

  const refreshModels = useCallback(async () => {
    try {
      setModels(await getLocalModels(client));
      setModelsError(null);
    } catch (caught) {
      setModelsError(errorText(caught));
    }
  }, [client]);
  useEffect(() => void refreshModels(), [refreshModels]);

  // Keep the stored choice only if the server still has it; otherwise offer its first model.
  // Read when applied, as the device's preselection is: a model picked meanwhile stands.
  useEffect(() => {
    const known = models ?? [];
    if (known.length === 0) return;
    update((current) => (known.some((model) => model.path === current.modelPath) ? {} : { modelPath: known[0]!.path }));
  }, [models, settings.modelPath, update]);

  // Until the person picks a device, preselect what this server can run (followServerDevice).
  const gpuAvailable = server.status?.gpu_available;
  useEffect(() => {
    if (gpuAvailable !== undefined) update(followServerDevice(gpuAvailable));
  }, [gpuAvailable, settings.deviceChosen, update]);

  const workers = parseWholeNumber(workersText);
  const batch = parseWholeNumber(batchText);
  const strategy = buildStrategy({ device: settings.device, workers, batch });
  const invalidField = strategy.ok ? null : strategy.field;

  const load = async () => {
    if (!strategy.ok) return;
    if (settings.modelPath === "") {
      setLoadNotice({ intent: "error", title: t("configsLoadFailed"), text: t("configsChooseModel") });
      return;
    }
    await runSwitch({ model: settings.modelPath, strategy: strategy.strategy });
  };

  const runSwitch = async (body: Parameters<typeof switchModel>[1]) => {
    setLoading(true);
    setLoadNotice(null);
    server.refresh();
    try {
      await switchModel(client, body);
      const name = models?.find((model) => model.path === body.model)?.name ?? body.model;
      setLoadNotice(body.model ? { intent: "success", title: t("configsLoaded", { model: name }), text: body.strategy } : null);
    } catch (caught) {
      // 304 is the runner's answer while another load is still running.
      const text = caught instanceof ApiError && caught.status === 304 ? t("configsLoadInProgress") : errorText(caught);
      setLoadNotice({ intent: "error", title: t("configsLoadFailed"), text });
    } finally {
      setLoading(false);
      server.refresh();
    }
  };

  const saveDefaults = async () => {
    try {
      await updateConfig(client, settings.serverDefaults);
      setDefaultsNotice({ intent: "success", title: t("configsDefaultsSaved"), text: "" });
    } catch (caught) {
      setDefaultsNotice({ intent: "error", title: t("configsDefaultsFailed"), text: errorText(caught) });
    }
  };

  const view = server.status ? statusView(server.status, server.loadedModelId, server.measuredRate) : null;

  return (
    <div style={{ display: "flex", flexDirection: "column", gap: 16, maxWidth: 760 }}>
      <Card>
        <Title3>{t("configsModel")}</Title3>
        <div style={{ display: "flex", gap: 8, alignItems: "end" }}>
          <Field label={t("configsModelLabel")} style={{ flexGrow: 1 }}>
            <Select
              data-testid="model-select"
              value={settings.modelPath}
              onChange={(_, data) => update({ modelPath: data.value })}
            >
              {(models ?? []).map((model) => (
                <option key={model.path} value={model.path}>
                  {model.name} ({formatBytes(model.size_bytes)})
                </option>
              ))}
            </Select>
          </Field>
          <Button onClick={() => void refreshModels()} data-testid="configs-refresh">
            {t("configsRefresh")}
          </Button>
        </div>
        {models !== null && models.length === 0 && <Text>{t("configsNoModels")}</Text>}
        {modelsError && <ErrorBar title={t("configsModelsFailed")} text={modelsError} />}
      </Card>

      <Card>
        <Title3>{t("configsDevice")}</Title3>
        <Field label={t("configsDevice")}>
          <Select
            data-testid="device-select"
            value={settings.device}
            onChange={(_, data) => update({ device: data.value as Device, deviceChosen: true })}
          >
            {DEVICES.map((device) => (
              <option key={device} value={device}>
                {t(DEVICE_LABELS[device])}
              </option>
            ))}
          </Select>
        </Field>
        {gpuAvailable === false && settings.device !== "cpu" && <Text data-testid="no-gpu-hint">{t("configsNoGpu")}</Text>}
        {usesWorkersAndBatch(settings.device) && (
          <div style={{ display: "flex", gap: 12 }}>
            <WholeNumberField
              label={t("configsWorkers")}
              hint={t("configsRangeHint", WORKERS_RANGE)}
              text={workersText}
              invalid={invalidField === "workers"}
              testId="workers-input"
              range={WORKERS_RANGE}
              onText={(text) => {
                setWorkersText(text);
                const value = parseWholeNumber(text);
                if (value >= WORKERS_RANGE.min && value <= WORKERS_RANGE.max) update({ workers: value });
              }}
            />
            <WholeNumberField
              label={t("configsBatch")}
              hint={t("configsRangeHint", BATCH_RANGE)}
              text={batchText}
              invalid={invalidField === "batch"}
              testId="batch-input"
              range={BATCH_RANGE}
              onText={(text) => {
                setBatchText(text);
                const value = parseWholeNumber(text);
                if (value >= BATCH_RANGE.min && value <= BATCH_RANGE.max) update({ batch: value });
              }}
            />
          </div>
        )}
        <Text data-testid="strategy-line">
          {t("configsCurrentStrategy")}:{" "}
          <code data-testid="strategy-value">{strategy.ok ? strategy.strategy : t("configsInvalidStrategy")}</code>
        </Text>
        <div style={{ display: "flex", gap: 8, alignItems: "center" }}>
          <Button appearance="primary" disabled={!strategy.ok || loading} onClick={() => void load()} data-testid="load-button">
            {loading ? t("configsLoading") : t("configsLoad")}
          </Button>
          <Button disabled={loading} onClick={() => void runSwitch({ model: "", strategy: strategy.ok ? strategy.strategy : "cpu fp32" })}>
            {t("configsUnload")}
          </Button>
          {loading && <Spinner size="tiny" />}
          <Text>{t("configsServerState")}:</Text>
          <StateBadge state={shownState(view, server.error)} />
        </div>
        {loadNotice && <NoticeBar notice={loadNotice} testId="load-notice" />}
      </Card>

      <Card>
        <Title3>{t("configsDefaults")}</Title3>
        <Text>{t("configsDefaultsHint")}</Text>
        <SamplingForm
          value={settings.serverDefaults}
          onChange={(next) => update({ serverDefaults: next })}
          testIdPrefix="defaults"
          columns={4}
        />
        <div>
          <Button onClick={() => void saveDefaults()} data-testid="save-defaults">
            {t("configsSaveDefaults")}
          </Button>
        </div>
        {defaultsNotice && <NoticeBar notice={defaultsNotice} testId="defaults-notice" />}
      </Card>
    </div>
  );
}

function WholeNumberField(props: {
  label: string;
  hint: string;
  text: string;
  invalid: boolean;
  testId: string;
  range: { min: number; max: number };
  onText: (text: string) => void;
}) {
  return (
    <Field
      label={props.label}
      hint={props.invalid ? undefined : props.hint}
      validationState={props.invalid ? "error" : "none"}
      validationMessage={props.invalid ? props.hint : undefined}
    >
      <Input
        type="number"
        min={props.range.min}
        max={props.range.max}
        step={1}
        value={props.text}
        data-testid={props.testId}
        onChange={(_, data) => props.onText(data.value)}
      />
    </Field>
  );
}

function NoticeBar({ notice, testId }: { notice: NonNullable<Notice>; testId: string }) {
  return (
    <MessageBar intent={notice.intent} data-testid={testId} data-intent={notice.intent} layout="multiline">
      <MessageBarBody>
        <MessageBarTitle>{notice.title}</MessageBarTitle>
        {/* Errors are shown whole: a load failure's reason is often a long traceback line. */}
        <span style={{ whiteSpace: "pre-wrap", overflowWrap: "anywhere" }}>{notice.text}</span>
      </MessageBarBody>
    </MessageBar>
  );
}

function ErrorBar({ title, text }: { title: string; text: string }) {
  return <NoticeBar notice={{ intent: "error", title, text }} testId="error-notice" />;
}

export function formatBytes(bytes: number): string {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${unit === 0 ? value : value.toFixed(1)} ${units[unit]}`;
}
